"""unit: the pieces of ``triode bench serve --peer llama.cpp`` and ``triode bench write-gguf``
that run without llama.cpp: random blocks that dequantize to sane weights, llama.cpp's
Q4_K_M recipe, the bytes a decode step reads, and the logit bias standing in for
``ignore_eos``; the peers' failures and a Ctrl-C while one runs, with stand-ins. (The peer
itself is built and run only by the benchmark, never here.)"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from tests.gguf_models import tiny_quantizable_llama, write_tiny_gguf
from triode.bench.peer import decode_weight_bytes, no_eos_bias
from triode.bench.synthetic_gguf import SHAPES, random_blocks, tensor_kinds


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
def test_random_blocks_are_small_centred_weights(kind):
    blocks = random_blocks(kind, 64, 512, np.random.default_rng(0))
    weights = dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(64, 512)
    assert np.isfinite(weights).all()
    assert np.abs(weights).max() <= 0.021
    assert abs(weights.mean()) < 0.002 and weights.std() > 0.004


def test_q4_k_m_follows_llama_cpps_recipe():
    kinds = tensor_kinds(SHAPES["llama-3.1-8b"], "Q4_K_M")
    assert kinds["output.weight"] == "Q6_K" and kinds["token_embd.weight"] == "Q4_K"
    more_bits = sorted(int(name.split(".")[1]) for name, kind in kinds.items()
                       if kind == "Q6_K" and name.endswith("ffn_down.weight"))
    assert more_bits == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert {kinds[f"blk.{i}.attn_v.weight"] for i in more_bits} == {"Q6_K"}
    assert kinds["blk.4.attn_v.weight"] == kinds["blk.4.attn_q.weight"] == "Q4_K"
    assert len(kinds) == 2 + 32 * 7


def test_decode_weight_bytes_and_the_eos_bias(tmp_path, tiny_tokenizer):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_quantizable_llama(tiny_tokenizer), tiny_tokenizer, "Q8_0")
    tensors = gguf.GGUFReader(path).tensors
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    assert decode_weight_bytes(path) == sum(int(t.n_bytes) for t in tensors) - int(embedding.n_bytes)
    assert no_eos_bias(path) == {"logit_bias": {str(tiny_tokenizer.eos_token_id): -100}}


def test_write_gguf_refuses_a_path_that_is_not_a_gguf_file(tmp_path, capsys):
    import argparse

    from triode.bench.synthetic_gguf import command

    target = tmp_path / "new" / "model.bin"
    with pytest.raises(SystemExit) as exit_:
        command(argparse.Namespace(path=str(target), shape="smollm2-135m", file_type="Q8_0", seed=0))
    assert exit_.value.code == 2  # a usage error, as argparse's
    assert "triode: error: write-gguf writes a .gguf file" in capsys.readouterr().err
    assert not target.parent.exists()


def test_amx_is_read_from_the_cpus_flags_and_named_in_the_report(tmp_path):
    from triode.bench.llama_server import cpu_reports_amx, llama_server_description

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags : fpu avx2 avx512f avx512_vnni amx_tile amx_int8\n")
    assert cpu_reports_amx(cpuinfo)
    cpuinfo.write_text("flags : fpu avx2 avx512f avx512_vnni\n")
    assert not cpu_reports_amx(cpuinfo)
    assert not cpu_reports_amx(tmp_path / "missing")
    assert llama_server_description(cpuinfo) == "llama-server from the llama-cpp-python==0.3.36 sdist"
    cpuinfo.write_text("flags : fpu avx2 avx512f amx_tile\n")
    assert llama_server_description(cpuinfo).endswith(", with its AMX kernels (their tile configuration fixed)")


# ggml_tile_config_init as llama-cpp-python 0.3.36 vendors it (ggml-cpu/amx/mmq.cpp), shortened.
_MMQ_AS_SHIPPED = """inline void ggml_tile_config_init(void) {
    static thread_local bool done = false;

    if (done) {
        return;
    }

    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    _tile_loadconfig(&tc);
    done = true;
}
"""


def test_llamas_amx_tile_configuration_gets_its_barrier_once(tmp_path):
    """As shipped, GCC drops the stores to the configuration before ldtilecfg and llama.cpp's
    AMX matmuls die of an illegal instruction on their first request (docs/benchmarks.md)."""
    from triode.bench.llama_server import fix_amx_tile_config

    mmq = tmp_path / "ggml" / "src" / "ggml-cpu" / "amx" / "mmq.cpp"
    mmq.parent.mkdir(parents=True)
    mmq.write_text(_MMQ_AS_SHIPPED)
    log = io.StringIO()
    assert fix_amx_tile_config(tmp_path, log)
    lines = mmq.read_text().splitlines()
    assert len(lines) == len(_MMQ_AS_SHIPPED.splitlines()) + 1
    load = lines.index("    _tile_loadconfig(&tc);")
    assert lines[load - 1].startswith('    __asm__ __volatile__("" : : "r"(&tc) : "memory");')
    assert "fixed the AMX tile configuration load" in log.getvalue()

    mmq.write_text(_MMQ_AS_SHIPPED.replace("_tile_loadconfig(&tc);", "_tile_loadconfig(&kept_config);"))
    log = io.StringIO()
    assert not fix_amx_tile_config(tmp_path, log)
    assert "_tile_loadconfig(&kept_config);" in mmq.read_text() and "__asm__" not in mmq.read_text()
    assert "does not apply" in log.getvalue()
    assert not fix_amx_tile_config(tmp_path / "no-sources", io.StringIO())


def test_a_machine_without_cmake_or_a_compiler_is_told_what_to_install(tmp_path, monkeypatch):
    from triode.bench import llama_server

    monkeypatch.setattr(llama_server.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(llama_server.PeerUnavailable, match=r"needs CMake and a C\+\+ compiler.*apt install"):
        llama_server.ensure_llama_server(tmp_path, tmp_path / "build.log", cpuinfo=tmp_path / "none")


def test_a_peer_that_dies_at_start_is_reported_with_its_log(tmp_path):
    from triode.bench.llama_server import PeerUnavailable, start_llama_server

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'error: no such model' >&2\nexit 3\n")
    binary.chmod(0o755)
    log = tmp_path / "peer.log"
    with pytest.raises(PeerUnavailable, match=rf"exit code 3\); see {log}"):
        start_llama_server(binary, tmp_path / "m.gguf", slots=2, slot_tokens=64, threads=1, port=9, log_path=log)
    assert "no such model" in log.read_text()


def test_a_peer_that_never_answers_is_stopped_at_the_deadline(tmp_path, monkeypatch):
    from triode.bench import llama_server

    monkeypatch.setattr(llama_server, "_READY_TIMEOUT_S", 1.0)
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexec sleep 60\n")  # alive, never listening
    binary.chmod(0o755)
    log = tmp_path / "peer.log"
    with pytest.raises(llama_server.PeerUnavailable, match=rf"did not answer /health within 1 s \(stopped\); see {log}"):
        llama_server.start_llama_server(binary, tmp_path / "m.gguf", slots=2, slot_tokens=64, threads=1, port=9,
                                        log_path=log)


def test_without_the_peer_triodes_figures_still_print_and_draw(tmp_path, capsys):
    from triode.bench.peer import _plot, _print_comparison

    level = {"concurrency": 1, "output_tokens_per_second": 90.0, "itl_p50_ms": 9.0, "ttft_p50_ms": 30.0,
             "mean_output_tokens": 128.0, "failed": 0}
    report = {"triode": [level], "llama_cpp": None, "peer_error": "llama-server did not start; see x.log",
              "weight_read_limit_ms": 3.0, "triode_resident_bytes": 2**30, "model_file": "m.gguf"}
    _print_comparison(report)
    printed = capsys.readouterr().out
    assert "90.00" in printed and "not measured: llama-server did not start; see x.log" in printed
    _plot(tmp_path / "peer.png", report)
    assert (tmp_path / "peer.png").stat().st_size > 0


@pytest.mark.parametrize("bench", ["serve", "throughput"])
def test_an_unknown_peer_is_refused_with_the_known_ones(bench):
    import subprocess

    from tests.http_server import BIN

    done = subprocess.run([str(BIN / "triode"), "bench", bench, "--peer", "sglang"],
                          capture_output=True, text=True)
    assert done.returncode == 2
    known = {"serve": "llama.cpp", "throughput": "vllm"}[bench]
    assert "invalid choice: 'sglang'" in done.stderr and known in done.stderr


def test_the_vllm_comparison_counts_the_same_work_and_names_a_failed_run(tmp_path):
    from triode.bench.peer_build import PeerUnavailable
    from triode.bench.throughput_peer import _compare
    from triode.bench.vllm_peer import hf_checkpoint, run_vllm
    from triode.bench.workloads import make_workload

    ours = {"startup_seconds": 5.0, "kv_cache_memory_bytes": 4 << 30,
            "workloads": {"W1v": {"tokens_per_second": 300.0, "preemptions": 0, "output_tokens": 4,
                                  "token_ids": [[1, 2], [3, 4]]}}}
    theirs = {"startup_seconds": 90.0,
              "workloads": {"W1v": {"tokens_per_second": 200.0, "output_tokens": 4, "token_ids": [[1, 2], [3, 5]]}}}
    entry = _compare("same", ours, theirs, {}, {})["workloads"]["W1v"]
    assert (entry["ratio"], entry["identical_greedy_share"]) == (1.5, 0.5)
    assert _compare("defaults", ours, None, {}, {})["workloads"]["W1v"]["vllm_tokens_per_second"] is None
    # A plain Hugging Face directory is read by both engines as it is.
    assert hf_checkpoint(tmp_path, "float32", tmp_path / "cache") == tmp_path
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'ImportError: libcudart.so.12' >&2\nexit 1\n")
    python.chmod(0o755)
    log = tmp_path / "vllm.log"
    with pytest.raises(PeerUnavailable, match=rf"vLLM failed: .*see {log}"):
        run_vllm(python, tmp_path, [make_workload("W1", vocab_size=49152)], engine={}, threads=[0], log=log)
    assert "libcudart" in log.read_text()
    # a runner that exits 0 with no result, a cut one, or fewer tokens than asked (a bare
    # FileNotFoundError, JSONDecodeError or AssertionError once, with triode's figures lost)
    short = '{"workloads": {"W1": {"output_tokens": 5}}}'
    for body, reason in [("exit 0", "no readable result"), ("""printf '{"work' > "$3\"""", "no readable result"),
                         (f"""printf '{short}' > "$3\"""", "produced 5 tokens of W1, which asks for 8192")]:
        python.write_text(f"#!/bin/sh\n{body}\n")
        with pytest.raises(PeerUnavailable, match=reason):
            run_vllm(python, tmp_path, [make_workload("W1", vocab_size=49152)], engine={}, threads=[0], log=log)


def test_ctrl_c_ends_a_peer_in_a_session_of_its_own(tmp_path):
    """Found by probing: vLLM runs in its own session (so the signals it sends its group on the
    way out spare triode), and so a Ctrl-C left it running, every core busy."""
    pid_file = tmp_path / "pid"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        from triode.bench.peer_build import run_logged
        with open({str(tmp_path / "peer.log")!r}, "w") as out:
            run_logged(["sh", "-c", "echo $$ > {pid_file}; exec sleep 1000"], out, "peer", own_session=True)
    """))
    runner = subprocess.Popen([sys.executable, str(script)])
    for _ in range(400):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    peer = int(pid_file.read_text())
    runner.send_signal(signal.SIGINT)
    assert runner.wait(30) != 0
    for _ in range(400):
        try:
            os.kill(peer, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(peer, signal.SIGKILL)
    pytest.fail("the peer outlived the Ctrl-C")


@pytest.mark.parametrize("arguments, message", [
    (["serve", "--num-prompts", "-1"], "argument --num-prompts: -1 is not a count from 1 to 1000000"),
    (["serve", "--concurrency", "8", "0"], "argument --concurrency: 0 is not a count"),
    (["serve", "--output-tokens", "0"], "argument --output-tokens: 0 is not a count"),
    (["step", "--steps", "0"], "argument --steps: 0 is not a count"),
    (["spec", "--rounds", "0"], "argument --rounds: 0 is not a count"),
    (["throughput", "--hf-batch-size", "x"], "argument --hf-batch-size: 'x' is not a whole number"),
    (["throughput", "--rounds", "3"], "--rounds alternates two engines or settings: it takes --peer or --compare-*"),
    (["throughput", "--peer", "vllm", "--rounds", "0"], "argument --rounds: 0 is not a count"),
    (["step", "--output-dir", "{file}"], "--output-dir {file}: File exists"),
])
def test_bad_counts_and_output_folders_are_refused_before_anything_runs(arguments, message, tmp_path, capsys):
    """Found by probing: 0 fell back to the default, a negative count or an output folder that
    is a file ran into a traceback, some after minutes of measuring."""
    from triode.frontend.cli import main

    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *(a.format(file=file) for a in arguments)])
    assert exit_.value.code == 2
    assert message.format(file=file) in capsys.readouterr().err


def test_an_interrupted_write_gguf_leaves_no_file(tmp_path, monkeypatch, tiny_tokenizer):
    """A Ctrl-C (or a full disk) half-way used to leave a truncated model at the path, which a
    later run loaded; now the file appears whole or not at all."""
    from types import SimpleNamespace

    import triode.engine.inputs
    import triode.engine.model_files.resolve
    from triode.bench import synthetic_gguf

    monkeypatch.setattr(triode.engine.model_files.resolve, "resolve_model", lambda *a, **k: SimpleNamespace(path=tmp_path))
    monkeypatch.setattr(triode.engine.inputs, "load_tokenizer", lambda path: tiny_tokenizer)
    monkeypatch.setattr(synthetic_gguf, "add_bpe_tokenizer", lambda writer, tokenizer, vocab_size: None)
    calls = []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return random_blocks(*args)

    monkeypatch.setattr(synthetic_gguf, "random_blocks", interrupted)
    target = tmp_path / "model.gguf"
    with pytest.raises(KeyboardInterrupt):
        synthetic_gguf.write_synthetic_gguf(target, "smollm2-135m", "Q8_0", progress=False)
    assert len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(synthetic_gguf, "random_blocks", random_blocks)
    size = synthetic_gguf.write_synthetic_gguf(target, "smollm2-135m", "Q8_0", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    assert target.stat().st_size == size


def test_vllm_rounds_alternate_the_engines_and_the_best_of_each_counts(tmp_path, monkeypatch, capsys):
    """--peer vllm --rounds 3: triode and vLLM take turns, each engine's fastest round is
    compared, every round is printed; a vLLM that fails in round 3 keeps rounds 1-2, and the
    next setting tries it again."""
    import json

    from triode.bench import throughput_peer
    from triode.bench.peer_build import PeerUnavailable

    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    monkeypatch.setattr(throughput_peer, "ensure_vllm", lambda cache, log: tmp_path / "python")
    monkeypatch.setattr(throughput_peer, "resolve_model", lambda model, cache_dir: type("M", (), {"path": tmp_path}))
    monkeypatch.setattr(throughput_peer, "hf_checkpoint", lambda path, dtype, cache: tmp_path / "checkpoint")
    monkeypatch.setattr(throughput_peer, "vllm_default_options", lambda: {"after": len(turns)})
    monkeypatch.setattr(throughput_peer, "ceilings", lambda config, workloads, **_: {
        name: {"peak_flops": {"triode": 1e12, "vllm": 1e12}, "peak_of": {"triode": "x", "vllm": "x"},
               "workloads": {"W1v": {"flops": 1e12, "triode_ceiling": 900.0, "vllm_ceiling": 900.0}}}
        for name in ("same", "defaults")})
    turns: list[str] = []

    def result(tokens_per_second):
        return {"startup_seconds": 2.0 + len(turns), "kv_cache_memory_bytes": 4 << 30,
                "workloads": {"W1v": {"tokens_per_second": tokens_per_second, "output_tokens": 16532,
                                      "preemptions": 0, "token_ids": [[1]]}}}

    def run_triode(model, workloads, options):
        turns.append("triode")
        return result({1: 300.0, 3: 500.0, 5: 400.0}.get(len(turns), 450.0))

    def run_vllm(python, model, workloads, *, engine, threads, log):
        turns.append("vllm")
        if len(turns) == 6:
            raise PeerUnavailable(f"vLLM failed: exit code 1; see {log}")
        return result({2: 250.0, 4: 200.0}.get(len(turns), 420.0))

    monkeypatch.setattr(throughput_peer, "run_triode", run_triode)
    monkeypatch.setattr(throughput_peer, "run_vllm", run_vllm)
    report = throughput_peer.run(model=None, workload_names=("W1v",), dtype="bfloat16", defaults=True,
                                 output_dir=tmp_path / "out", rounds=3)
    assert turns == ["triode", "vllm"] * 3 + ["triode", "vllm"] * 3
    assert len(report["comparisons"]) == 2
    same = report["comparisons"]["same"]["workloads"]["W1v"]
    assert same["triode_rounds"] == [300.0, 500.0, 400.0] and same["vllm_rounds"] == [250.0, 200.0]
    assert (same["triode_tokens_per_second"], same["vllm_tokens_per_second"], same["ratio"]) == (500.0, 250.0, 2.0)
    assert report["comparisons"]["same"]["triode_startup_seconds"] == 3.0  # the first round's: a fresh start
    defaults = report["comparisons"]["defaults"]["workloads"]["W1v"]
    assert defaults["vllm_rounds"] == [420.0] * 3
    # vLLM's defaults were read after triode's last round, just before vLLM's
    assert report["comparisons"]["defaults"]["vllm_options"] == {"after": 11}
    printed = capsys.readouterr().out
    assert "each engine's best of 3 rounds" in printed
    assert "300.00 / 250.00" in printed and "400.00 / -" in printed
    assert "vLLM: left out after that: vLLM failed: exit code 1" in printed
    assert (tmp_path / "out" / "throughput-vllm-bfloat16.png").stat().st_size > 0


def test_vllm_default_memory_share_leaves_room_for_its_own_processes(monkeypatch):
    """vLLM's worker refuses to start when the share it is given is not free by then: the share
    is what is free less 3 GiB for vLLM's own processes, rounded down, at most vLLM's 0.92."""
    from triode.bench import throughput_peer
    from triode.engine.worker import kv_budget

    gib = 1 << 30
    readings = iter([kv_budget.MemoryReading(total=int(23.54 * gib), available=int(22.5 * gib), on_gpu=False),
                     kv_budget.MemoryReading(total=256 * gib, available=250 * gib, on_gpu=False)])
    monkeypatch.setattr(kv_budget, "read_memory", lambda device_type: next(readings))
    assert throughput_peer.vllm_default_options() == {"gpu_memory_utilization": 0.82}
    assert throughput_peer.vllm_default_options() == {"gpu_memory_utilization": 0.92}
