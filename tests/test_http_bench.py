"""HTTP tests: ``triode bench serve`` at a tiny scale (it starts its own server, sweeps two
concurrency levels, runs the same chats offline, and writes its JSON and PNG)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.http_server import BIN


@pytest.mark.slow
def test_bench_serve_small(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama")
    result = subprocess.run(
        [str(BIN / "triode"), "bench", "serve", "--model", str(model), "--kv-cache-memory", "64MiB",
         "--max-model-len", "512", "--concurrency", "1", "3", "--num-prompts", "3", "--prompt-tokens", "16",
         "--output-tokens", "8", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "load generator CPU time" in result.stdout and "of offline" in result.stdout
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 3]
    for level in report["levels"]:
        assert level["failed"] == 0 and level["mean_output_tokens"] == 8
        assert level["ttft_p50_ms"] > 0 and level["itl_p99_ms"] >= level["itl_p50_ms"] > 0
    assert report["offline"]["output_tokens_per_second"] > 0 and report["served_over_offline"] > 0
    assert report["offline_capped"]["max_num_seqs"] == max(level["concurrency"] for level in report["levels"])
    assert report["served_over_offline_capped"] > 0
    assert (tmp_path / "serve.png").stat().st_size > 0
