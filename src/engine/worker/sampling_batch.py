"""The sampler's view of one step: every sampled row's parameters and token history, turned
into the dense tensors the sampler works on (one row per sampled sequence, one column per
vocabulary entry), built once per step in the worker.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import attrs
import torch

from triode.engine.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class SamplingRow:
    """One sequence that gets a token this step. ``output_token_ids`` is what it generated so far
    and its length is the index of the token drawn now, so a seeded row's draw depends on
    (seed, index) alone. ``banned_token_ids`` get -inf: the stop logic decides which (e.g. EOS and
    stop ids until ``min_tokens`` is reached), the sampler only applies them."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _float(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor | None:
    return _long(values, device) if values else None


def _columns(
    entries: Sequence[tuple[float, ...]], device: torch.device
) -> tuple[torch.Tensor, ...] | None:
    """(row, token id[, value]) entries as one tensor per column: a sparse list of positions."""
    if not entries:
        return None
    rows, tokens, *values = zip(*entries, strict=True)
    return (_long(rows, device), _long(tokens, device), *(_float(v, device) for v in values))


def _bincount_rows(
    histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """Token counts per row, [len(histories), V], by one scatter_add over the flattened histories
    (flat rather than padded: no pad column, no wasted work on short rows)."""
    counts = torch.zeros(len(histories) * vocab_size, dtype=torch.float32, device=device)
    flat = _long(list(itertools.chain.from_iterable(histories)), device)
    if flat.numel():
        lengths = _long([len(h) for h in histories], device)
        rows = torch.repeat_interleave(torch.arange(len(histories), device=device), lengths)
        ones = torch.ones_like(flat, dtype=torch.float32)
        counts.scatter_add_(0, rows * vocab_size + flat, ones)
    return counts.view(len(histories), vocab_size)


@attrs.frozen(kw_only=True, eq=False)
class SamplingBatch:
    """The rows of one step as tensors, built once per step. Features that no row uses are None or
    False so that ``Sampler.sample`` skips them; an all-greedy batch without penalties costs one
    argmax (plus logprobs where asked)."""

    size: int
    vocab_size: int
    device: torch.device
    greedy_rows: torch.Tensor | None  # None: no greedy row
    random_rows: torch.Tensor | None  # None: no random row
    # [B]; greedy rows and disabled features hold neutral values, so masks pass them through
    temperature: torch.Tensor
    top_k: torch.Tensor  # V where disabled
    top_p: torch.Tensor
    min_p: torch.Tensor
    use_temperature: bool
    use_top_k: bool
    max_top_k: int
    use_top_p: bool
    use_min_p: bool
    bias: tuple[torch.Tensor, ...] | None  # rows, token ids, values
    banned: tuple[torch.Tensor, ...] | None  # rows, token ids
    penalty_rows: torch.Tensor | None  # the P rows with a penalty; the fields below are [P], [P, V]
    repetition_penalty: torch.Tensor | None
    seen_mask: torch.Tensor | None  # in prompt or output: where the repetition penalty applies
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None
    # positions among the random rows: unseeded ones share the Sampler's generator
    unseeded_positions: torch.Tensor | None
    seeded: tuple[tuple[int, int, int], ...]  # (position among random rows, seed, token index)
    logprob_rows: torch.Tensor | None
    num_logprobs: tuple[int | None, ...]

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], *, vocab_size: int, device: torch.device
    ) -> SamplingBatch:
        device, vocab = torch.device(device), vocab_size
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        params = [r.params for r in rows]
        # Greedy rows get neutral values so that whole-batch masks leave them alone.
        temperature = [1.0 if p.greedy else p.temperature for p in params]
        top_k = [vocab if p.greedy else min(p.effective_top_k or vocab, vocab) for p in params]
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        min_p = [0.0 if p.greedy else p.min_p for p in params]
        random_k = [top_k[i] for i in random]
        seeded = [(pos, p.seed, len(rows[i].output_token_ids))
                  for pos, i in enumerate(random) if (p := rows[i].params).seed is not None]
        unseeded = [pos for pos, i in enumerate(random) if rows[i].params.seed is None]
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias]
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]

        penalized = [
            i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        ]
        rep = seen = freq = pres = counts = None
        if penalized:
            pen = [params[i] for i in penalized]
            pen_rows = [rows[i] for i in penalized]
            history = _bincount_rows([r.output_token_ids for r in pen_rows], vocab, device)
            if any(p.repetition_penalty != 1.0 for p in pen):
                prompt = _bincount_rows([r.prompt_token_ids for r in pen_rows], vocab, device)
                seen = (prompt > 0) | (history > 0)
                rep = _float([p.repetition_penalty for p in pen], device)
            if any(p.frequency_penalty or p.presence_penalty for p in pen):
                counts = history
                freq = _float([p.frequency_penalty for p in pen], device)
                pres = _float([p.presence_penalty for p in pen], device)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            size=len(rows), vocab_size=vocab, device=device,
            greedy_rows=_index(greedy, device), random_rows=_index(random, device),
            temperature=_float(temperature, device), top_k=_long(top_k, device),
            top_p=_float(top_p, device), min_p=_float(min_p, device),
            use_temperature=any(t != 1.0 for t in temperature),
            use_top_k=any(k < vocab for k in random_k), max_top_k=max(random_k, default=vocab),
            use_top_p=any(p < 1.0 for p in top_p), use_min_p=any(p > 0.0 for p in min_p),
            bias=_columns(bias, device), banned=_columns(banned, device),
            penalty_rows=_index(penalized, device), repetition_penalty=rep, seen_mask=seen,
            frequency_penalty=freq, presence_penalty=pres, output_counts=counts,
            unseeded_positions=_index(unseeded, device), seeded=tuple(seeded),
            logprob_rows=_index(logprob_rows, device),
            num_logprobs=tuple(p.logprobs for p in params),
        )


def rows_repeat_after(params: SamplingParams) -> float:
    """The output tokens past which a sequence's sampling row is the same every step (no more
    tokens banned once min_tokens are out), or never (inf): a seeded draw depends on the token's
    index, and penalties count the output. A worker works it out once per sequence."""
    if (params.seed is not None or params.repetition_penalty != 1.0 or params.frequency_penalty
            or params.presence_penalty):
        return math.inf
    return params.min_tokens


class SamplingBatchCache:
    """The last step's batch, kept while the same sequences sample alike: most decode steps
    then build none."""

    def __init__(self, *, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._last: tuple[tuple[str, ...], SamplingBatch] | None = None

    def batch(self, seq_ids: Sequence[str], rows: Callable[[], Sequence[SamplingRow]], *,
              reusable: bool) -> SamplingBatch:
        """The batch of ``rows()`` for these sequences; ``reusable``: every row is as in the
        step before (``rows_repeat_after``), so the last batch serves if it had these ids."""
        key = tuple(seq_ids)
        if reusable and self._last is not None and self._last[0] == key:
            return self._last[1]
        batch = SamplingBatch.build(rows(), vocab_size=self.vocab_size, device=self.device)
        self._last = (key, batch) if reusable else None
        return batch
