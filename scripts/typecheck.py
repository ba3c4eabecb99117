#!/usr/bin/env python3
"""mypy over triode, as pyproject.toml's ``[tool.mypy]`` sets it (strict); ``make test`` and
``make typecheck`` run it. The packages listed in CHECKED are checked, what they import is
followed silently. src/ is the package ``triode``, which mypy cannot find through setuptools'
editable-install hook, so it checks a temporary folder holding a link named ``triode`` to src/
and reports the paths as src/... ."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]
# The engine's policy, its actors, its two drivers and the public API's modules (LLM, its
# parameters, options, outputs and errors, the wire messages): strict. Widen the list as other
# packages get there.
CHECKED = ("triode.engine.core", "triode.engine.actors", "triode.engine.llm_engine", "triode.engine.async_llm",
           "triode.engine.sync_bridge", "triode.engine.spec_decode", "triode.engine.llm", "triode.engine.outputs",
           "triode.engine.sampling_params", "triode.engine.pooling_params", "triode.engine.config",
           "triode.engine.errors", "triode.engine.inputs", "triode.engine.chat_options",
           "triode.engine.engine_stats", "triode.engine.worker_messages", "triode.engine.lora.request",
           "triode.engine.lora.peft_files", "triode.engine.structured.params", "triode")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="triode-mypy-") as folder:
        (Path(folder) / "triode").symlink_to(ROOT / "src", target_is_directory=True)
        os.environ["MYPYPATH"] = folder
        arguments = ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache")]
        for name in CHECKED:
            is_package = (ROOT / "src" / name.removeprefix("triode.").replace(".", "/")).is_dir()
            arguments += ["-p" if is_package else "-m", name]
        stdout, stderr, status = api.run(arguments)
        print(stdout.replace(f"{folder}/triode/", "src/"), end="")
        print(stderr, end="", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
