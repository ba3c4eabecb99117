"""What the forkserver imports after torch (triode.engine.actors.worker_spawn): ``gc.freeze()``.

It moves every object that torch's import made into the collector's permanent generation,
as Python's documentation advises before forking. The workers forked from the forkserver
then never touch those objects' pages when they collect (the pages stay shared), and the
forkserver's own exit, when the process that started it ends, skips collecting them: that
collection over torch's objects kept it alive past the program by over a second on a loaded
machine. In any other process that imports this module, the objects alive at that moment
are only never collected, which changes no result.
"""

from __future__ import annotations

import gc

gc.freeze()
