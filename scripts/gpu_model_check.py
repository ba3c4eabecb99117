#!/usr/bin/env python3
"""GPU check of the engine's model path: our runner on CUDA (Triton attention, KV write, norms,
rotary) against Hugging Face transformers on the same GPU, on tiny random models of every
supported architecture, by the rules the CPU contract tests use:

- float32: greedy token ids identical and logprobs within 1e-3 (tests.hf_compare.assert_matches_hf);
  chunked prefill (7-token chunks) gives the same tokens as one-shot prefill;
- bfloat16: vLLM's closeness rule (tests.hf_compare.assert_close_to_hf);
- decode steps replayed from CUDA graphs against ``enforce_eager`` steps, at every batch size up
  to the prompts' count (padded buckets): tokens identical, logprobs within rounding (on a
  CPU the graphs' buffers are replayed eagerly); the runner checks above capture graphs too;
- the whole engine, ``LLM(device=device)`` with its worker process, in float32 with a token
  budget and KV cache small enough to force chunked prefill and preemption, with async
  scheduling off and on: the same tokens as HF, and every KV block free afterwards.
- pooling models, ``LLM(runner="pooling").embed`` with a 16-token budget: a Qwen3 decoder's
  last token and a BERT encoder's CLS, normalized, within 1e-4 of transformers' hidden states.

    python scripts/gpu_model_check.py                 # on a CUDA machine, about a minute
    python scripts/gpu_model_check.py --device cpu    # the same checks on the CPU

Needs the project's runtime packages (trio and trio-parallel for the engine) and the test
helpers in tests/. Exit status: 0 all good, 1 a mismatch or an error, 2 no CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from source_tree import use_source_tree

use_source_tree()  # triode and the tests package, without an install

MAX_TOKENS = 24


def check_runner(path: Path, prompts: list[list[int]], device: str) -> list[str]:
    """The runner alone, driven step by step: float32 exact, chunked = one-shot, bf16 close."""
    import torch
    from tests.hf_compare import assert_close_to_hf, assert_matches_hf, hf_greedy, ours_greedy

    reference = hf_greedy(path, prompts, MAX_TOKENS, device=device)
    ours = ours_greedy(path, prompts, MAX_TOKENS, dtype="float32", device=device)
    assert_matches_hf(ours, reference)
    chunked = ours_greedy(path, prompts, MAX_TOKENS, dtype="float32", device=device, chunk_size=7)
    assert [t for t, _ in chunked] == [t for t, _ in ours], "chunked prefill differs from one-shot"
    reference = hf_greedy(path, prompts, MAX_TOKENS, dtype=torch.bfloat16, device=device)
    ours = ours_greedy(path, prompts, MAX_TOKENS, dtype="bfloat16", device=device)
    # bfloat16 moves a mixture of experts' router logits enough to swap an expert at a near-tie,
    # which moves the logprobs far more than rounding does: there, vLLM's rule alone (tokens)
    moe = "num_experts_per_tok" in (path / "config.json").read_text()
    assert_close_to_hf(ours, reference, logprob_atol=None if moe else 0.1)
    identical = sum(tokens == hf_tokens for (tokens, _), (hf_tokens, _) in zip(ours, reference, strict=True))
    return ["float32 identical", "chunked identical", f"bf16 close ({identical}/{len(prompts)} prompts identical)"]


def check_graphs(path: Path, prompts: list[list[int]], device: str) -> list[str]:
    """Decode steps replayed from CUDA graphs (on a CPU: the same buffers, replayed eagerly)
    against ``enforce_eager`` steps: tokens identical, logprobs within bf16 / f32 rounding."""
    from tests.hf_compare import greedy_params, make_driver

    from triode.engine.worker.cuda_graphs import EagerReplay

    results = []
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 0.05)) if device == "cuda" else (("float32", 1e-4),):
        eager = make_driver(path, dtype=dtype, device=device, enforce_eager=True)
        graphs = make_driver(path, dtype=dtype, device=device,
                             decode_graph_capture=None if device == "cuda" else EagerReplay())
        assert eager.runner.graphs is None and graphs.runner.graphs is not None, "no decode graphs captured"
        # Every batch size from 1 to all prompts, so most steps run a padded bucket.
        for count in range(1, len(prompts) + 1):
            want = eager.generate(prompts[:count], greedy_params(MAX_TOKENS), name=f"e{count}")
            got = graphs.generate(prompts[:count], greedy_params(MAX_TOKENS), name=f"g{count}")
            assert [t for t, _ in got] == [t for t, _ in want], f"{dtype}, {count} prompts: tokens differ"
            worst = max(abs(a.logprob - b.logprob) for (_, la), (_, lb) in zip(got, want, strict=True)
                        for a, b in zip(la, lb, strict=True))
            assert worst <= atol, f"{dtype}, {count} prompts: logprobs differ by {worst}"
        buckets = graphs.runner.graphs.buckets
        results.append(f"{dtype} graphs = eager at batch 1..{len(prompts)} ({len(buckets)} buckets, "
                       f"captured in {graphs.runner.graphs.capture_seconds:.1f}s)")
    return results


def check_engine(path: Path, prompts: list[list[int]], device: str) -> list[str]:
    """The whole engine in a worker process on the GPU, squeezed so it chunks and preempts."""
    from tests.hf_compare import hf_greedy

    from triode import LLM, SamplingParams

    reference = hf_greedy(path, prompts, MAX_TOKENS, device=device)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [tokens for tokens, _ in reference]
    results = []
    for async_scheduling in (False, True):
        with LLM(str(path), device=device, dtype="float32", max_num_batched_tokens=16, block_size=16,
                 max_model_len=128, kv_cache_memory=_blocks_of(path, 9), async_scheduling=async_scheduling) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.llm_engine.statistics()
        got = [list(o.outputs[0].token_ids) for o in outputs]
        assert got == want, f"engine tokens (async scheduling {async_scheduling}) differ from HF: {got} vs {want}"
        assert stats.kv_blocks_free == stats.kv_blocks_total, stats
        results.append(f"async scheduling {'on' if async_scheduling else 'off'}: identical to HF, "
                       f"{stats.num_preemptions} preemptions, blocks all free")
    return results


def check_pooling(path: Path, prompts: list[list[int]], device: str) -> list[str]:
    """Embeddings (chunked for the decoder, whole for the encoder) against HF's hidden states."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    from triode import LLM

    is_encoder = "Bert" in (path / "config.json").read_text()
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval().to(device)
    with LLM(str(path), runner="pooling", device=device, dtype="float32", max_model_len=128,
             kv_cache_memory="64MiB", max_num_batched_tokens=16) as llm:
        outputs = llm.embed(prompts, use_tqdm=False)
    worst = 0.0
    for ids, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            states = model(torch.tensor([ids], device=device)).last_hidden_state[0]
        expected = F.normalize((states[0] if is_encoder else states[-1]).float(), dim=-1).cpu()
        worst = max(worst, (torch.tensor(output.outputs.embedding) - expected).abs().max().item())
    assert worst < 1e-4, f"embeddings differ from HF by {worst:.2e}"
    return [f"{len(outputs)} embeddings ({'CLS' if is_encoder else 'last token'}), max |triode - HF| {worst:.1e}"]


def _blocks_of(path: Path, blocks: int) -> int:
    """Bytes of KV cache for ``blocks`` blocks of 16 tokens in float32."""
    import json

    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    return blocks * 16 * per_token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = parser.parse_args(argv).device
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_model_check: no CUDA device here", file=sys.stderr)
        return 2
    from tests.hf_compare import TINY_MODEL_TEXTS
    from tests.tiny_models import (
        ARCHITECTURES,
        build_tiny_encoder,
        build_tiny_model,
        train_tokenizer,
    )

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"gpu_model_check: {name}; torch {torch.__version__}")
    tokenizer = train_tokenizer()
    prompts = [tokenizer.encode(text) for text in TINY_MODEL_TEXTS]
    failures = 0
    with tempfile.TemporaryDirectory() as scratch:
        paths = {}
        for arch in sorted(ARCHITECTURES):
            (Path(scratch) / arch).mkdir()
            paths[arch] = build_tiny_model(Path(scratch) / arch, arch, tokenizer)
        checks = [(f"runner {arch}", check_runner, path) for arch, path in paths.items()]
        checks.append(("graphs llama", check_graphs, paths["llama"]))
        checks.append(("graphs gemma2", check_graphs, paths["gemma2"]))  # windows and soft caps
        checks.append(("engine llama", check_engine, paths["llama"]))
        checks.append(("pooling qwen3", check_pooling, paths["qwen3"]))
        (Path(scratch) / "bert").mkdir()
        checks.append(("pooling bert", check_pooling, build_tiny_encoder(Path(scratch) / "bert", "bert", tokenizer)))
        for label, check, path in checks:
            started = time.monotonic()
            try:
                result = "; ".join(check(path, prompts, device))
                status = "ok  "
            except Exception as error:  # report every check, fail at the end
                traceback.print_exc()
                result, status = f"{type(error).__name__}: {error}"[:300], "FAIL"
                failures += 1
            print(f"  {status} {label}: {result} ({time.monotonic() - started:.1f}s)", flush=True)
    print(f"{len(checks) - failures}/{len(checks)} checks ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
