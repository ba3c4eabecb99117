"""Token sampling for one model step: logits [B, V] in, one token (and its logprobs) per row out.

Runs inside worker processes, so it imports torch and the plain parameter classes, never trio.
Processing order follows vLLM: logit bias and banned tokens, repetition penalty, frequency and
presence penalties; then greedy rows take the argmax while random rows go through temperature,
top-k, top-p and min-p, softmax and an exponential race. Logprobs describe the raw model
distribution (vLLM v1's default), not the processed one. The step's rows arrive as a
:class:`~triode.engine.worker.sampling_batch.SamplingBatch`. Prompt logprobs come from here too.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from triode import kernels
from triode.engine.worker.sampling_batch import SamplingBatch
from triode.engine.worker_messages import ScheduledChunk, TokenLogprobs

if TYPE_CHECKING:
    from triode.engine.worker.row_sampling import WorkerSequence
    from triode.engine.worker.step_inputs import StepInputs

_NEG_INF = float("-inf")
# Exp(1) noise can be exactly 0; 0/0 would be NaN and argmax picks NaN, so floor it.
_TINY = torch.finfo(torch.float32).tiny


@attrs.frozen(kw_only=True, eq=False)
class Draws:
    """What ``Sampler.draw`` gives for a batch: each row's token as ``sample`` would choose it,
    and for the random rows (``batch.random_rows`` order) the distribution it was drawn from
    after temperature and truncation, and the Exp(1) noise of its race (speculative decoding
    draws from what is left of that distribution with the same noise)."""

    token_ids: torch.Tensor  # [B]
    probs: torch.Tensor | None  # [random rows, V]
    noise: torch.Tensor | None


@attrs.frozen(kw_only=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the request asked for no logprobs


def _check_shape(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.shape != (batch.size, batch.vocab_size):
        shape = (batch.size, batch.vocab_size)
        raise ValueError(f"logits have shape {tuple(logits.shape)}, the batch needs {shape}")


def _adjust_(x: torch.Tensor, batch: SamplingBatch) -> None:
    if batch.bias is not None:
        rows, tokens, values = batch.bias
        x.index_put_((rows, tokens), values, accumulate=True)
    if batch.banned is not None:
        x[batch.banned] = _NEG_INF
    if batch.penalty_rows is None:
        return
    rows = batch.penalty_rows
    sub = x if rows.numel() == batch.size else x[rows]
    if batch.seen_mask is not None and batch.repetition_penalty is not None:
        rep = batch.repetition_penalty[:, None]
        sub = torch.where(batch.seen_mask, torch.where(sub > 0, sub / rep, sub * rep), sub)
    counts, freq, pres = batch.output_counts, batch.frequency_penalty, batch.presence_penalty
    if counts is not None and freq is not None and pres is not None:
        sub = sub - counts * freq[:, None] - (counts > 0) * pres[:, None]
    x[rows] = sub


def adjust_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, banned tokens and penalties applied to a float32 copy of ``logits``."""
    _check_shape(logits, batch)
    x = logits.to(torch.float32, copy=True)
    _adjust_(x, batch)
    return x


def _truncate(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    *, use_k: bool, max_k: int, use_p: bool, use_min_p: bool,
) -> torch.Tensor:
    """Masks with -inf every token outside top-k, top-p (of the distribution renormalized over
    top-k) and min-p. Each mask is a per-row value cutoff, so tokens tied with the last one kept
    are all kept: the result never depends on how a sort orders ties."""
    if not (use_k or use_p or use_min_p):
        return x
    cutoff = x.new_full((x.shape[0], 1), _NEG_INF)
    if use_p:
        sorted_x = x.sort(dim=-1, descending=True).values
        if use_k:
            cutoff = sorted_x.gather(1, (top_k - 1)[:, None])
            sorted_x = sorted_x.masked_fill(sorted_x < cutoff, _NEG_INF)
        probs = sorted_x.softmax(dim=-1)
        # Mass strictly before each position; a true exclusive cumsum stays monotone in floats.
        before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
        # top_p == 1 keeps all: rounding must not make the sum reach 1 before the tail.
        keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        # The top token always stays: a top_p under float32's smallest value (1e-50) is 0 here.
        kept = keep.sum(dim=-1, keepdim=True).clamp_min(1)
        cutoff = torch.maximum(cutoff, sorted_x.gather(1, kept - 1))
        row_max = sorted_x[:, :1]
    elif use_k:
        top = x.topk(max_k, dim=-1).values  # cheaper than a full sort when k is small
        cutoff = top.gather(1, (top_k - 1)[:, None])
        row_max = top[:, :1]
    else:
        row_max = x.amax(dim=-1, keepdim=True)
    if use_min_p:
        # p_i >= min_p * p_max, in logit space: no softmax needed, and renormalization-invariant.
        cutoff = torch.maximum(cutoff, row_max + min_p[:, None].log())
    return x.masked_fill(x < cutoff, _NEG_INF)


def mask_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k / top-p / min-p masks of the batch's random rows applied to ``logits`` as given (no
    temperature); greedy rows come back unchanged."""
    _check_shape(logits, batch)
    return _truncate(
        logits.float(), batch.top_k, batch.top_p, batch.min_p, use_k=batch.use_top_k,
        max_k=batch.vocab_size if batch.greedy_rows is not None else batch.max_top_k,
        use_p=batch.use_top_p, use_min_p=batch.use_min_p,
    )


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_tops: Sequence[int]
) -> list[TokenLogprobs]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    max_top = min(max(num_tops, default=0), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in num_tops]
    top_ids: list[list[int]] = [[] for _ in num_tops]
    if max_top:
        top = logprobs.topk(max_top, dim=-1)  # one topk for the largest N, sliced per row
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    columns = (token_ids.tolist(), chosen.squeeze(1).tolist(), ranks, top_ids, top_values, num_tops)
    return [
        TokenLogprobs(
            token_id=token, logprob=lp, rank=rank, top=tuple(zip(ids[:n], values[:n], strict=True))
        )
        for token, lp, rank, ids, values, n in zip(*columns, strict=True)
    ]


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """log_softmax of ``logits`` [N, V] at ``token_ids`` [N], with each token's rank (1 = most
    likely) and the ``num_top`` most likely (token id, logprob) pairs; also for prompt logprobs."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    if logits.ndim != 2 or ids.shape != (logits.shape[0],):
        shapes = f"{tuple(logits.shape)} and {tuple(ids.shape)}"
        raise ValueError(f"logits and token ids do not match: {shapes}")
    return _logprobs(logits, ids, [num_top] * len(ids))


def prompt_logprobs_of_step(model: Any, chunks: Sequence[ScheduledChunk], inputs: StepInputs, hidden: torch.Tensor,
                            sequences: Mapping[str, WorkerSequence]) -> tuple[tuple[str, tuple[TokenLogprobs, ...]], ...]:
    """(seq id, logprobs of the prompt tokens its chunk predicts) for the sequences that asked,
    from the step's ``hidden`` states (``model.compute_logits`` is None but on rank 0)."""
    results = []
    for index, chunk in enumerate(chunks):
        seq = sequences[chunk.seq_id]
        if seq.params.prompt_logprobs is None:
            continue
        prompt = seq.prompt_token_ids
        # Row p predicts prompt[p + 1]; only positions inside the prompt have a target.
        end = min(chunk.start_position + chunk.num_tokens, len(prompt) - 1)
        if end <= chunk.start_position:
            continue
        first_row = inputs.first_token_rows[index]
        logits = model.compute_logits(hidden[first_row : first_row + end - chunk.start_position])
        if logits is None:
            continue  # not rank 0 (which computes them); the gather above was its part
        targets = torch.tensor(prompt[chunk.start_position + 1 : end + 1], device=hidden.device)
        logprobs = compute_logprobs(logits, targets, seq.params.prompt_logprobs)
        results.append((chunk.seq_id, tuple(logprobs)))
    return tuple(results)


def _derive_seed(seed: int, index: int, stream: int = 0) -> int:
    # A stable hash (not Python's hash()) so a seeded draw survives worker restarts and versions;
    # stream 1 is speculative decoding's acceptance draws, independent of the token's race.
    packed = struct.pack("<qq", seed, index) if stream == 0 else struct.pack("<qqq", seed, index, stream)
    digest = hashlib.blake2b(packed, digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Samples one token per row. Unseeded random rows share one generator seeded with
    ``generator_seed``; each seeded row draws from a generator seeded with (seed, token index)."""

    def __init__(self, generator_seed: int) -> None:
        self._generator_seed = generator_seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._reseeded: dict[torch.device, torch.Generator] = {}

    def _generator(
        self, cache: dict[torch.device, torch.Generator], device: torch.device
    ) -> torch.Generator:
        if device not in cache:
            cache[device] = torch.Generator(device=device)
            cache[device].manual_seed(self._generator_seed)
        return cache[device]

    def _noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if batch.unseeded_positions is not None:
            shared = self._generator(self._shared, probs.device)
            if not batch.seeded:
                noise.exponential_(generator=shared)
            else:
                noise[batch.unseeded_positions] = torch.empty(
                    (batch.unseeded_positions.numel(), probs.shape[1]), device=probs.device
                ).exponential_(generator=shared)
        for position, seed, index in batch.seeded:
            generator = self._generator(self._reseeded, probs.device)
            generator.manual_seed(_derive_seed(seed, index))
            # A whole row of V draws from a fresh seed: independent of the row's batch neighbours.
            noise[position].exponential_(generator=generator)
        return noise.clamp_min_(_TINY)

    def _sample_random(self, x: torch.Tensor, batch: SamplingBatch,
                       keep: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(tokens, probabilities, noise) of the random rows; without ``keep`` the last two are
        None (the race divides the probabilities in place)."""
        temperature, top_k, top_p, min_p = batch.temperature, batch.top_k, batch.top_p, batch.min_p
        if batch.greedy_rows is not None and batch.random_rows is not None:
            rows = batch.random_rows
            temperature, top_k = temperature[rows], top_k[rows]
            top_p, min_p = top_p[rows], min_p[rows]
        if batch.use_temperature:
            x = x / temperature[:, None]
        x = _truncate(
            x, top_k, top_p, min_p, use_k=batch.use_top_k, max_k=batch.max_top_k,
            use_p=batch.use_top_p, use_min_p=batch.use_min_p,
        )
        probs = x.softmax(dim=-1)
        noise = self._noise(probs, batch)
        # Exponential race: argmax(p / Exp(1)) is a draw from p, and each row's noise is its own.
        if not keep:
            return kernels.argmax(probs.div_(noise)), None, None
        return kernels.argmax(probs / noise), probs, noise

    def draw(self, logits: torch.Tensor, batch: SamplingBatch, *, keep_distributions: bool = False) -> Draws:
        """Every row's token, and with ``keep_distributions`` the random rows' distributions
        and noise (see ``Draws``)."""
        _check_shape(logits, batch)
        x = logits.float()
        if batch.bias is not None or batch.banned is not None or batch.penalty_rows is not None:
            x = adjust_logits(logits, batch)  # a copy: logprobs need the raw logits
        probs = noise = None
        if batch.random_rows is None:
            tokens = kernels.argmax(x)
        elif batch.greedy_rows is None:
            tokens, probs, noise = self._sample_random(x, batch, keep_distributions)
        else:
            tokens = torch.empty(batch.size, dtype=torch.long, device=x.device)
            tokens[batch.greedy_rows] = kernels.argmax(x[batch.greedy_rows])
            tokens[batch.random_rows], probs, noise = self._sample_random(x[batch.random_rows], batch,
                                                                          keep_distributions)
        return Draws(token_ids=tokens, probs=probs, noise=noise)

    def uniforms(self, batch: SamplingBatch, positions: Sequence[int], device: torch.device) -> list[float]:
        """One U(0, 1) draw for each of the given random rows (positions among them): a seeded
        row's from its (seed, token index), independent of its race's noise."""
        seeds = {position: (seed, index) for position, seed, index in batch.seeded}
        unseeded = [p for p in positions if p not in seeds]
        shared = iter(torch.rand(len(unseeded), generator=self._generator(self._shared, device),
                                 device=device).tolist() if unseeded else ())
        draws = []
        for position in positions:
            if position in seeds:
                generator = self._generator(self._reseeded, device)
                generator.manual_seed(_derive_seed(*seeds[position], stream=1))
                draws.append(torch.rand(1, generator=generator, device=device).item())
            else:
                draws.append(next(shared))
        return draws

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        _check_shape(logits, batch)
        if batch.size == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        tokens = self.draw(logits, batch).token_ids

        logprobs: list[TokenLogprobs | None] = [None] * batch.size
        if batch.logprob_rows is not None:
            rows = batch.logprob_rows
            wanted = [n for n in batch.num_logprobs if n is not None]
            entries = _logprobs(logits[rows], tokens[rows], wanted)
            for row, entry in zip(rows.tolist(), entries, strict=True):
                logprobs[row] = entry
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)
