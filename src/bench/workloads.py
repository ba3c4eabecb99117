"""The fixed benchmark workloads: synthetic prompts of exact token lengths from a fixed seed."""

from __future__ import annotations

import random

import attrs


@attrs.frozen(kw_only=True)
class Workload:
    name: str
    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)


# The token ids prompts are drawn from: past the special and byte tokens vocabularies begin
# with, and below 40,000, so that every model with a larger vocabulary gets the same prompts
# (those of docs/benchmarks.md's figures), and one with a smaller vocabulary (Llama 2's and
# Mistral's 32,000) prompts of its own ids, where ids past it were refused.
PROMPT_TOKEN_IDS = range(1000, 40000)


def prompt_token_ids(vocab_size: int) -> range:
    """The ids a model of ``vocab_size`` tokens gets prompts of."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size: expected a positive number of tokens; got {vocab_size}")
    stop = min(PROMPT_TOKEN_IDS.stop, vocab_size)
    return range(min(PROMPT_TOKEN_IDS.start, stop // 4), stop)


def _prompt(rng: random.Random, length: int, ids: range) -> tuple[int, ...]:
    return tuple(rng.randrange(ids.start, ids.stop) for _ in range(length))


def make_workload(name: str, *, vocab_size: int, seed: int = 0) -> Workload:
    """W1: 64 prompts of 128 tokens, 128 out each. W1v: 128 prompts, 16-512 in, 16-256 out.
    Their token ids are within ``vocab_size``, the model's (``prompt_token_ids``)."""
    vocab = prompt_token_ids(vocab_size)
    rng = random.Random(f"{name}-{seed}")
    if name == "W1":
        return Workload(
            name=name,
            prompts=tuple(_prompt(rng, 128, vocab) for _ in range(64)),
            output_lens=(128,) * 64,
        )
    if name == "W1v":
        input_lens = [rng.randint(16, 512) for _ in range(128)]
        output_lens = tuple(rng.randint(16, 256) for _ in range(128))
        return Workload(
            name=name,
            prompts=tuple(_prompt(rng, n, vocab) for n in input_lens),
            output_lens=output_lens,
        )
    raise ValueError(f"unknown workload {name!r}; choose W1 or W1v")
