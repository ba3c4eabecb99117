"""Runs a command as a user would (stdin, stdout and stderr passed through) and then checks
that it left no process behind.

This process makes itself the child subreaper (Linux ``prctl``), so a worker process that
outlives the script it belongs to is re-parented here instead of to init, where it could
not be seen. Once the command has exited, any child still alive after ``GRACE_SECONDS`` is
reported on stderr as ``ORPHANS: pid (command line) ...`` and killed, and the exit status becomes 99.

Usage: python tests/script_runner.py COMMAND [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Run as a script: its own folder is on sys.path.
from process_tree import command_line

PR_SET_CHILD_SUBREAPER = 36
# The forkserver exits once the script has, and tearing down its interpreter (torch imported)
# took over a second under load: a process still there after this is left behind.
GRACE_SECONDS = 5.0
ORPHANS_STATUS = 99


def _children() -> list[int]:
    """Pids of this process's live children (zombies are reaped, not counted)."""
    me = str(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, parent = fields[0], fields[1]
        if parent != me:
            continue
        if state == "Z":
            os.waitpid(int(entry.name), os.WNOHANG)
        else:
            found.append(int(entry.name))
    return found


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"script_runner: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 2
    # As from a terminal: a shell starts background jobs with SIGINT ignored, which a child
    # would inherit (and Python then never raises KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = subprocess.run(argv, check=False).returncode
    deadline = time.monotonic() + GRACE_SECONDS
    while (orphans := _children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if orphans:
        described = (f"{pid} ({command_line(pid)[:200].decode(errors='replace') or 'gone'})" for pid in orphans)
        print(f"ORPHANS: {' '.join(described)}", file=sys.stderr, flush=True)
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        return ORPHANS_STATUS
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
