"""Unit tests: what each process imports. The engine process (every entry layer and the
server) imports no torch: the workers load the model, and a start-up without torch is
seconds faster. Worker-side modules import no trio, so workers start light."""

from __future__ import annotations

import subprocess
import sys


def _imports(modules: str, forbidden: str) -> list[str]:
    code = (f"import sys, {modules}; "
            f"print(' '.join(m for m in sys.modules if m == {forbidden!r} or m.startswith({forbidden + '.'!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.split()


def test_the_engine_process_imports_no_torch():
    entry_layers = "triode.engine.llm, triode.engine.llm_engine, triode.engine.async_llm, triode.frontend.factory, triode.frontend.cli"
    assert _imports(entry_layers, "torch") == []


def test_worker_modules_import_no_trio():
    assert _imports("triode.engine.worker.process, triode.engine.worker.sampler, triode.engine.worker.calls", "trio") == []
