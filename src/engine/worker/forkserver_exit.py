"""What the forkserver imports besides torch (triode.engine.actors.worker_spawn): an exit
that does not wait.

The forkserver ends when the process that started it does. An interpreter that imported
torch then spends a second or more of CPU tearing down modules and collecting objects, only
to give the memory back, and so outlives the program by that much on a loaded machine; a
supervisor that waits for every process of a service waits for it. It has no output to
flush and nothing to save, so at exit it ends at once. The workers forked from it inherit
the handler but never run it: multiprocessing ends them with ``os._exit`` already.
"""

from __future__ import annotations

import atexit
import os

atexit.register(os._exit, 0)
