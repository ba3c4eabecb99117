"""What both peers' set-up shares: a command run with its output in a log (and the compile's
progress, or the count of lines, on screen), and the error that leaves a peer out."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from typing import TextIO

_PROGRESS = re.compile(r"^\[\s*(\d+)%\]")


class PeerUnavailable(Exception):
    """The peer could not be installed, built or started; the message names the log to read."""


def run_logged(command: list[str], out: TextIO, what: str, *, progress: str | None = None,
               env: dict[str, str] | None = None, own_session: bool = False) -> None:
    """Runs ``command`` with its output appended to ``out``; ``progress`` draws a bar:
    ``"percent"`` follows CMake's ``[ 42%]`` lines, ``"lines"`` counts the tool's lines.
    ``own_session``: the command and what it starts are a process group of their own, out of
    reach of the signals it sends its group on the way out."""
    print(f"  {what} ...", flush=True)
    out.write(f"$ {' '.join(command)}\n")
    out.flush()
    bar = None
    if progress is not None:
        from tqdm import tqdm

        bar = tqdm(total=100, desc=f"  {what}", bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}") \
            if progress == "percent" else tqdm(desc=f"  {what}", unit=" lines")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=own_session) as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                out.write(line)
                if bar is None:
                    continue
                if bar.total is None:
                    bar.update()
                elif match := _PROGRESS.match(line):
                    bar.update(int(match.group(1)) - bar.n)
        except BaseException:  # Ctrl-C: a session of its own does not get it, so it is ended here
            end_process(process, group=own_session)
            raise
    if bar is not None:
        bar.close()
    if process.returncode != 0:
        raise PeerUnavailable(f"{what} failed (exit code {process.returncode}); see {out.name}")


def end_process(process: subprocess.Popen, *, group: bool = False, grace: float = 10.0) -> None:
    """SIGTERM to the process (to its whole process group with ``group``), then SIGKILL once
    ``grace`` seconds have passed; returns when it has exited."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
