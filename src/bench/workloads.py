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


def _prompt(rng: random.Random, length: int, vocab: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.randrange(*vocab) for _ in range(length))


def make_workload(name: str, *, vocab: tuple[int, int] = (1000, 40000), seed: int = 0) -> Workload:
    """W1: 64 prompts of 128 tokens, 128 out each. W1v: 128 prompts, 16-512 in, 16-256 out."""
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
