"""Comparing our runner's greedy output with Hugging Face transformers' generate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import GenerationConfig

from tests.driver import Driver
from triode.bench.report import load_hf_reference
from triode.engine.config import EngineArgs
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker.runner import ModelRunner
from triode.engine.worker_messages import TokenLogprobs

TOP = 5
# Mixed lengths, and characters split across byte-level tokens.
TINY_MODEL_TEXTS = (
    "The quick brown fox",
    "Paris is the capital of",
    "A paged key-value cache stores attention keys in fixed-size blocks of tokens, and "
    "structured concurrency keeps every task inside a nursery.",
    "héllo 世界",
    "def add(a, b):",
)


def hf_greedy(path: Path, prompts: Sequence[Sequence[int]], max_tokens: int, *, dtype=torch.float32,
              device: str = "cpu", adapter: Path | None = None):
    """(token ids, per-step log-softmax rows, on the CPU) for each prompt, one prompt at a time
    so that no padding enters the comparison. A directory holding a GGUF file (the default
    model's cache entry) is read from that file, as transformers dequantizes it. ``adapter``:
    a PEFT adapter's directory, run as ``PeftModel`` runs it."""
    model = load_hf_reference(path, dtype, device)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    # Without this, generate merges the model's own EOS back in and stops early.
    model.generation_config.eos_token_id = None
    config = GenerationConfig(
        max_new_tokens=max_tokens, min_new_tokens=None, do_sample=False,
        eos_token_id=None, pad_token_id=0, bos_token_id=None,
        output_logits=True, return_dict_in_generate=True,
    )
    results = []
    for prompt in prompts:
        input_ids = torch.tensor([list(prompt)], device=device)
        with torch.no_grad():
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), dim=-1).cpu() for step in out.logits]
        results.append((tokens, logprobs))
    return results


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)


def make_driver(path: Path, *, dtype: str = "auto", device: str = "auto", max_model_len: int = 512,
                enforce_eager: bool = False, decode_graph_capture=None,
                quantized_activations: str = "float32") -> Driver:
    """Quantized weights multiply float32 activations here unless asked otherwise: the tight
    comparisons with HF are of that arithmetic (int8 activations have tests of their own)."""
    args = EngineArgs(model=str(path), kv_cache_memory=64 << 20, max_model_len=max_model_len, dtype=dtype,
                      device=device, enforce_eager=enforce_eager, quantized_activations=quantized_activations)
    return Driver(ModelRunner(args, path, decode_graph_capture=decode_graph_capture))


def ours_greedy(path: Path, prompts, max_tokens: int, *, dtype: str = "auto", device: str = "auto",
                max_model_len: int = 512, quantized_activations: str = "float32", **driver_options):
    driver = make_driver(path, dtype=dtype, device=device, max_model_len=max_model_len,
                         quantized_activations=quantized_activations)
    return driver.generate(prompts, greedy_params(max_tokens), **driver_options)


def _tops(logprobs: TokenLogprobs, hf_row: torch.Tensor) -> tuple[list[int], list[int]]:
    """(our top-5 token ids, HF's top-5 token ids) at one step."""
    return [t for t, _ in logprobs.top], torch.topk(hf_row, TOP).indices.tolist()


def assert_matches_hf(
    ours: list[tuple[list[int], list[TokenLogprobs | None]]],
    reference,
    *,
    logprob_atol: float = 1e-3,
) -> None:
    """Token ids identical; logprobs close; at a mismatch (vLLM's rule) each side's token must
    be in the other's top-5, which turns a near-tie into a clear message."""
    for index, ((tokens, logprobs), (hf_tokens, hf_logprobs)) in enumerate(zip(ours, reference, strict=True)):
        for step, (token, hf_token) in enumerate(zip(tokens, hf_tokens, strict=True)):
            hf_row = hf_logprobs[step]
            ours_top, hf_top = _tops(logprobs[step], hf_row)
            assert token == hf_token, (
                f"prompt {index}, step {step}: ours {token} vs HF {hf_token} "
                f"(ours in HF top-5: {token in hf_top}, HF in our top-5: {hf_token in ours_top})"
            )
            assert abs(logprobs[step].logprob - hf_row[token].item()) < logprob_atol
            for top_token, top_logprob in logprobs[step].top:
                assert abs(top_logprob - hf_row[top_token].item()) < logprob_atol


def assert_close_to_hf(
    ours: list[tuple[list[int], list[TokenLogprobs | None]]],
    reference,
    *,
    logprob_atol: float | None,
) -> None:
    """vLLM's rule for two implementations that round differently (e.g. both in bfloat16):
    until the first differing token the chosen tokens' logprobs agree within ``logprob_atol``
    (None: vLLM's own rule, tokens only); at that token each side's choice is in the other's
    top-5, and the contexts part there."""
    for index, ((tokens, logprobs), (hf_tokens, hf_logprobs)) in enumerate(zip(ours, reference, strict=True)):
        for step, (token, hf_token) in enumerate(zip(tokens, hf_tokens, strict=True)):
            if token != hf_token:
                ours_top, hf_top = _tops(logprobs[step], hf_logprobs[step])
                assert token in hf_top and hf_token in ours_top, (
                    f"prompt {index}, step {step}: ours {token} vs HF {hf_token}, not a near-tie")
                break
            if logprob_atol is not None:
                assert abs(logprobs[step].logprob - hf_logprobs[step][token].item()) < logprob_atol, (index, step)
