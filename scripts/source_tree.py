"""``import triode`` from this source tree where triode is not installed (the bare GPU machine
the device tool lends). src/ is the ``triode`` package, so a temporary folder holding a link
named ``triode`` to it goes first on ``sys.path``; with triode installed this does nothing. The
scripts also put the repository root on the path, for the test helpers in ``tests/``."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_source_tree() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("triode") is not None:
        return
    folder = Path(tempfile.mkdtemp(prefix="triode-src-"))
    (folder / "triode").symlink_to(ROOT / "src", target_is_directory=True)
    sys.path.insert(0, str(folder))
