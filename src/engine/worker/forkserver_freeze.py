"""What the forkserver imports after torch (triode.engine.actors.worker_spawn): ``gc.freeze()``.

It moves every object that torch's import made into the collector's permanent generation,
as Python's documentation advises before forking. The workers forked from the forkserver
then never touch those objects' pages when they collect (the pages stay shared), and the
forkserver's own exit, when the process that started it ends, skips collecting them: that
collection over torch's objects kept it alive past the program by over a second on a loaded
machine. Only the forkserver freezes: a process that imports every module (a test, a
documentation tool) keeps its collector as it was, and its objects' own exit-time checks
(triton's, for one) as quiet as they were.
"""

from __future__ import annotations

import gc
import sys
from multiprocessing import forkserver


def _imported_by_the_forkserver() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _imported_by_the_forkserver():
    gc.freeze()
