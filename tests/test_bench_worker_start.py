"""script: `triode bench start`, engine start-up and recovery from a worker SIGKILL with
workers forked from the forkserver and spawned, on a tiny model; a round that fails reports
its error output."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.http_server import BIN
from triode.bench.worker_start import PARTS, measure_here, measure_in_child
from triode.engine.actors.worker_spawn import MULTIPROC_METHODS


def test_a_round_measures_both_starts_and_a_recovery(tiny_model_factory):
    figures = measure_here(str(tiny_model_factory("llama")))
    assert sorted(figures) == sorted(PARTS)
    assert figures["first_start_s"] > 0 and figures["next_start_s"] > 0
    assert figures["recovery_s"] > 0  # a restart and a load, beyond the request itself


def test_a_failed_round_says_which_method_and_why(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)the spawn round exited with status 1:.*no-such-model"):
        measure_in_child(str(tmp_path / "no-such-model"), "spawn")


@pytest.mark.slow  # two interpreters and six engines: make test-all runs it
def test_the_command_compares_the_methods_round_by_round(tiny_model_factory, tmp_path):
    done = subprocess.run([str(BIN / "triode"), "bench", "start", "--model", str(tiny_model_factory("llama")),
                           "--rounds", "1", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "spawn / forkserver" in done.stdout and "recovery" in done.stdout
    payload = json.loads((tmp_path / "worker-start.json").read_text())
    assert sorted(payload["rounds"]) == sorted(MULTIPROC_METHODS)
    assert [len(rounds) for rounds in payload["rounds"].values()] == [1, 1]
    assert payload["best"] == {method: rounds[0] for method, rounds in payload["rounds"].items()}
    assert (tmp_path / "worker-start.png").stat().st_size > 0
