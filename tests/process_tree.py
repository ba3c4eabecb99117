"""Process trees from /proc, for tests that check what an engine or a server leaves running.

Workers fork from multiprocessing's forkserver (triode.engine.actors.worker_spawn), so they
are grandchildren of the process that runs the engine, and the forkserver and its resource
tracker live as long as that process: they serve every engine it opens, not one."""

from __future__ import annotations

import os
from pathlib import Path

MULTIPROCESSING_HELPERS = (b"from multiprocessing.forkserver import main",
                           b"from multiprocessing.resource_tracker import main")


def _running() -> dict[int, int]:
    """{pid: parent pid} of every process that is not a zombie."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if state != "Z":
            parents[int(entry.name)] = int(parent)
    return parents


def command_line(pid: int) -> bytes:
    """The process's command line, its arguments joined by spaces (empty once it is gone)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        return b""


def _is_helper(pid: int) -> bool:
    return any(helper in command_line(pid) for helper in MULTIPROCESSING_HELPERS)


def descendants(pid: int | None = None, *, helpers: bool = False) -> set[int]:
    """Running processes below ``pid`` (this process by default), every generation. Unless
    ``helpers``, the forkserver and the resource tracker started by ``pid`` itself are left
    out, but not the workers forked from that forkserver."""
    root = os.getpid() if pid is None else pid
    parents = _running()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    if not helpers:
        found -= {child for child in found if parents.get(child) == root and _is_helper(child)}
    return found
