"""script: `triode bench step --overhead` on a small run: the host cost of a step through
LLM.generate and its parts, from the engine's and the worker's own timers."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.http_server import BIN
from triode.bench.overhead import PARTS

pytestmark = pytest.mark.default_model  # its tokenizer, for the tiny model


@pytest.mark.slow  # a quarter of a minute: make test-all runs it
def test_the_overhead_bench_splits_the_host_cost_of_a_step(tmp_path):
    done = subprocess.run([str(BIN / "triode"), "bench", "step", "--overhead", "--batch-sizes", "1", "4",
                           "--steps", "6", "--repeats", "1", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wall ms" in done.stdout and "detokenize" in done.stdout
    rows = json.loads((tmp_path / "step_overhead.json").read_text())["rows"]
    assert [(row["async_scheduling"], row["batch"]) for row in rows] == [(False, 1), (False, 4), (True, 1), (True, 4)]
    for row in rows:
        assert row["steps"] >= 6  # the prefill and the decodes
        assert row["forward_ms"] > 0 and row["host_ms"] == pytest.approx(row["total_ms"] - row["forward_ms"])
        assert row["total_ms"] == pytest.approx(row["forward_ms"] + sum(row[part] for part in PARTS))
        measured = [part for part in PARTS if part not in ("other", "detokenize")]
        assert all(row[part] > 0 for part in measured), {part: row[part] for part in measured}
        assert row["detokenize"] >= 0
    assert (tmp_path / "step_overhead.png").stat().st_size > 0
