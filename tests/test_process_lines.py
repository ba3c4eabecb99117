"""Unit tests: what each process imports. The engine process (every entry layer and the
server) imports no torch: the workers load the model, and a start-up without torch is
seconds faster. Worker-side modules import no trio, so workers start light."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _imports(modules: str, forbidden: str) -> list[str]:
    code = (f"import sys, {modules}; "
            f"print(' '.join(m for m in sys.modules if m == {forbidden!r} or m.startswith({forbidden + '.'!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return result.stdout.split()


def test_the_engine_process_imports_no_torch():
    entry_layers = "triode.engine.llm, triode.engine.llm_engine, triode.engine.async_llm, triode.frontend.server.factory, triode.frontend.cli"
    assert _imports(entry_layers, "torch") == []


def test_worker_modules_import_no_trio():
    assert _imports("triode.engine.worker.process, triode.engine.worker.sampler, triode.engine.worker.calls", "trio") == []


def _runtime_modules() -> list[str]:
    """Every module of the runtime packages but the command line (which registers the tools'
    subcommands)."""
    import pkgutil

    import triode

    names = []
    for package in ("engine", "frontend", "kernels"):
        module = __import__(f"triode.{package}", fromlist=["__path__"])
        names += [info.name for info in pkgutil.walk_packages(module.__path__, f"triode.{package}.")
                  if info.name != "triode.frontend.cli"]
    assert names and triode.__name__ == "triode"
    return names


def test_the_runtime_imports_no_tool():
    modules = _runtime_modules()
    assert len(modules) > 100
    assert _imports(", ".join(modules), "triode.bench") == []
    assert _imports(", ".join(modules), "triode.scenarios") == []


def test_the_scenario_runner_imports_nothing_of_the_runtime():
    """It drives servers through their command line, HTTP and signals, as a user would."""
    for package in ("triode.engine", "triode.frontend", "triode.kernels"):
        assert _imports("triode.scenarios.command", package) == []


@pytest.mark.parametrize("protocol, at_least", [("openai", 10), ("anthropic", 3), ("responses", 3)])
def test_the_protocols_import_neither_the_server_nor_the_routes(protocol, at_least):
    import pkgutil

    package = __import__(f"triode.frontend.{protocol}", fromlist=["__path__"])
    modules = [info.name for info in pkgutil.walk_packages(package.__path__, f"triode.frontend.{protocol}.")]
    assert len(modules) >= at_least
    for forbidden in ("triode.frontend.server", "triode.frontend.routes"):
        assert _imports(", ".join(modules), forbidden) == []
