"""What a worker keeps of each sequence, and the sampling of a step's rows from their logits.

Rank 0 samples: it masks the rows whose sequence follows a grammar, bans the tokens that may
not end a request before its ``min_tokens``, builds the sampler's batch (or reuses the last
step's, while the same sequences sample alike), samples, and appends each token to its
sequence; a verifying step's rows go to the draft verifier instead. Under tensor parallelism
with plans made ahead, rank 0 broadcasts the tokens and the other ranks append them too.
"""

from __future__ import annotations

import time

import attrs
import torch

from triode.engine.lora.request import LoRARequest
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import SamplingParams
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.grammar import SequenceGrammars, apply_allowed_tokens_
from triode.engine.worker.sampler import Sampler
from triode.engine.worker.sampling_batch import (
    SamplingBatch,
    SamplingBatchCache,
    SamplingRow,
    rows_repeat_after,
)
from triode.engine.worker.speculation import DraftVerifier
from triode.engine.worker_messages import AcceptedDrafts, SampledTokens

__all__ = ["RowSampling", "WorkerSequence"]


@attrs.define
class WorkerSequence:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None
    # its sampling row is as in the step before once it has more output tokens than this
    repeats_after: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.repeats_after = rows_repeat_after(self.params)


def banned_at(seq: WorkerSequence, num_output_tokens: int, grammar_complete: bool) -> tuple[int, ...]:
    """The tokens a sequence may not sample after ``num_output_tokens``: until min_tokens are
    out, neither EOS nor a stop token may end the request; but a grammar that is complete
    allows nothing else, and then it wins."""
    params = seq.params
    if num_output_tokens >= params.min_tokens or grammar_complete:
        return ()
    eos = () if params.ignore_eos else seq.eos_token_ids
    return eos + params.stop_token_ids


class RowSampling:
    """A rank's sampling of the rows of its steps. ``prepare_seconds`` and
    ``grammar_seconds`` add up the time spent building the sampler's batches and following
    grammars, for the step's timings."""

    def __init__(self, sampler: Sampler, sequences: dict[str, WorkerSequence], *, vocab_size: int,
                 device: torch.device, grammars: SequenceGrammars | None, parallel: TensorParallelGroup | None,
                 follows_samples: bool, verifies: bool) -> None:
        """``sequences``: the worker's, by id (tokens are appended to them); ``follows_samples``:
        plans are made ahead under tensor parallelism, so every rank feeds the tokens rank 0
        sampled; ``verifies``: this rank verifies proposed tokens (rank 0 when speculating)."""
        self.sampler = sampler
        self.sequences = sequences
        self.grammars = grammars
        self.parallel = parallel
        self.follows_samples = follows_samples
        self.verifier = DraftVerifier(sampler, grammars, vocab_size=vocab_size, banned=banned_at) if verifies else None
        self._batches = SamplingBatchCache(vocab_size=vocab_size, device=device)
        self.prepare_seconds = 0.0
        self.grammar_seconds = 0.0

    def sample(self, logits: torch.Tensor | None, seq_ids: list[str], drafts: dict[str, tuple[int, ...]] | None, *,
               speculates: bool) -> tuple[SampledTokens, tuple[AcceptedDrafts, ...]]:
        """(sampled, accepted proposals) of the rows of ``seq_ids`` (``logits``: rank 0's, one
        row each; None on the other ranks); ``drafts``: the proposals a verifying step feeds;
        ``speculates``: the step verifies or proposes (no plan is made ahead of it)."""
        follows = self.follows_samples and not speculates
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples, and says what
            if follows:
                tokens = self.parallel.broadcast_tokens(None, len(seq_ids))
                for seq_id, token_id in zip(seq_ids, tokens, strict=True):
                    self.sequences[seq_id].output_token_ids.append(token_id)
            return SampledTokens(), ()
        if drafts is not None:
            assert self.verifier is not None
            return self.verifier.sample(logits, seq_ids, self.sequences, drafts)
        sequences = [self.sequences[seq_id] for seq_id in seq_ids]
        constrained = self._constrain_(logits, seq_ids)
        prepare_started = time.perf_counter()
        batch = self._batch(seq_ids, sequences)
        self.prepare_seconds += time.perf_counter() - prepare_started
        output = self.sampler.sample(logits, batch)
        if follows:
            self.parallel.broadcast_tokens(output.token_ids, len(seq_ids))
        for seq, token_id in zip(sequences, output.token_ids, strict=True):
            seq.output_token_ids.append(token_id)
        if constrained:
            for seq_id, token_id in zip(seq_ids, output.token_ids, strict=True):
                if seq_id in constrained:
                    self.grammars.accept(seq_id, token_id)
        logprobs = tuple(output.logprobs) if batch.logprob_rows is not None else ()
        return SampledTokens(tuple(seq_ids), tuple(output.token_ids), logprobs), ()

    def _batch(self, seq_ids: list[str], sequences: list[WorkerSequence]) -> SamplingBatch:
        def rows() -> list[SamplingRow]:
            return [SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                                output_token_ids=seq.output_token_ids, banned_token_ids=self._banned(seq, seq_id))
                    for seq_id, seq in zip(seq_ids, sequences, strict=True)]

        reusable = all(len(seq.output_token_ids) > seq.repeats_after for seq in sequences)
        return self._batches.batch(seq_ids, rows, reusable=reusable)

    def _constrain_(self, logits: torch.Tensor, seq_ids: list[str]) -> set[str]:
        """Masks, in place, the logits of the rows whose sequence follows a grammar (before
        sampling and logprobs, as vLLM does); returns those sequences."""
        if not self.grammars:
            return set()
        started = time.perf_counter()
        rows = [row for row, seq_id in enumerate(seq_ids) if seq_id in self.grammars]
        if rows:
            bitmask = self.grammars.allowed_tokens([seq_ids[row] for row in rows])
            index = None if len(rows) == len(seq_ids) else torch.tensor(rows, device=logits.device)
            apply_allowed_tokens_(logits, index, bitmask)
        self.grammar_seconds += time.perf_counter() - started
        return {seq_ids[row] for row in rows}

    def _banned(self, seq: WorkerSequence, seq_id: str) -> tuple[int, ...]:
        if len(seq.output_token_ids) >= seq.params.min_tokens:
            return ()
        complete = self.grammars is not None and seq_id in self.grammars and self.grammars.is_complete(seq_id)
        return banned_at(seq, len(seq.output_token_ids), complete)
