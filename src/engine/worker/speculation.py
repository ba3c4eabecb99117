"""The worker's side of speculative decoding: proposing tokens after a step, and verifying a
step's proposed tokens.

A chunk that verifies feeds its sequence's token and the k proposals after it. The worker
runs it as k + 1 one-token decodes of that sequence at consecutive positions, sharing its
block table: every layer writes the step's keys and values before any row attends, so row i
sees the first i proposals, and each row goes through the decode kernels exactly as a plain
decode step would (the C decode stack, CUDA graphs and LoRA rows included), which is what
makes a greedy speculative output the plain output token for token (docs/architecture.md,
"Batch invariance"). The rows are then verified together (``triode.engine.worker.rejection``).

A proposer (``NgramProposer``, ``draft_model.DraftModelProposer``) sees the sequences' tokens
after the step and returns up to the number the plan asked for; a trained head (EAGLE) would
sit in the same place, after the step's sampling, with the step's hidden states at hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from triode.engine.config import EngineArgs
from triode.engine.spec_decode.config import SpeculativeConfig
from triode.engine.spec_decode.ngram import NgramIndex
from triode.engine.worker.draft_model import DraftModelProposer, ProposalRequest
from triode.engine.worker.grammar import SequenceGrammars, apply_allowed_tokens_
from triode.engine.worker.rejection import DraftRows, verify
from triode.engine.worker.sampler import Sampler, compute_logprobs
from triode.engine.worker.sampling_batch import SamplingBatch, SamplingRow
from triode.engine.worker_messages import AcceptedDrafts, Proposal, SampledTokens, ScheduledChunk

if TYPE_CHECKING:
    from triode.engine.worker.row_sampling import WorkerSequence


def expand_drafts(chunks: Sequence[ScheduledChunk], chunk_tokens: Sequence[tuple[int, ...]]):
    """(chunks, their tokens, each verifying sequence's proposals), the verifying chunks cut
    into one-token decodes (the first keeps the new blocks); the proposals are None when no
    chunk verifies."""
    if not any(chunk.num_draft_tokens for chunk in chunks):
        return chunks, chunk_tokens, None
    drafts: dict[str, tuple[int, ...]] = {}
    out_chunks: list[ScheduledChunk] = []
    out_tokens: list[tuple[int, ...]] = []
    for chunk, tokens in zip(chunks, chunk_tokens, strict=True):
        count = chunk.num_draft_tokens
        if not count:
            out_chunks.append(chunk)
            out_tokens.append(tokens)
            continue
        if len(tokens) != count + 1 or chunk.sampled_input or not chunk.sample:
            raise ValueError(f"chunk of {chunk.seq_id!r} verifies {count} proposed tokens after "
                             f"{len(tokens) - count} tokens; it must feed exactly one before them")
        drafts[chunk.seq_id] = tokens[1:]
        for offset, token in enumerate(tokens):
            out_chunks.append(ScheduledChunk(chunk.seq_id, (token,), chunk.start_position + offset,
                                             chunk.new_block_ids if offset == 0 else ()))
            out_tokens.append((token,))
    return out_chunks, out_tokens, drafts


class NgramProposer:
    """Prompt lookup over each sequence's prompt and output (``spec_decode.ngram``), its index
    kept between steps and extended by the tokens each step adds."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._indexes: dict[str, NgramIndex] = {}

    def forget(self, seq_id: str) -> None:
        self._indexes.pop(seq_id, None)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[tuple[int, ...]]:
        proposals = []
        for seq_id, prompt_token_ids, output_token_ids, num_tokens in requests:
            index = self._indexes.get(seq_id)
            if index is None:
                index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n, prompt_token_ids)
            index.extend(output_token_ids[len(index) - len(prompt_token_ids):])
            proposals.append(index.propose(num_tokens))
        return proposals


class Proposer(Protocol):
    """What proposes tokens after a step: prompt lookup, a draft model, or (later) a trained
    head, which would also read the step's hidden states."""

    def forget(self, seq_id: str) -> None: ...

    def propose(self, requests: Sequence[ProposalRequest]) -> list[tuple[int, ...]]: ...


def propose_after_step(proposer: Proposer, chunks: Sequence[ScheduledChunk],
                       sequences: Mapping[str, WorkerSequence]) -> tuple[Proposal, ...]:
    """Proposed tokens for the sequences whose chunks ask for them, after this step's."""
    requests = [(chunk.seq_id, (seq := sequences[chunk.seq_id]).prompt_token_ids, seq.output_token_ids,
                 chunk.propose) for chunk in chunks if chunk.propose]
    proposed = proposer.propose(requests) if requests else []
    return tuple(Proposal(request[0], tokens) for request, tokens in zip(requests, proposed, strict=True) if tokens)


def proposer_for(args: EngineArgs, *, rank: int, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 budget_bytes: int, block_size: int) -> Proposer | None:
    """What proposes tokens on this rank: rank 0 proposes and verifies (every rank runs a
    verifying chunk's rows); None without speculative decoding."""
    config = args.speculative_config
    if config is None or rank != 0:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftModelProposer(args, device=device, dtype=dtype, max_model_len=max_model_len,
                              budget_bytes=budget_bytes, block_size=block_size)


class DraftVerifier:
    """Samples a step whose chunks verify proposals: every sequence's rows (one per proposal
    and one more) get the grammar masks and the sampling rows they would have one token at a
    time, then ``rejection.verify`` keeps what the target accepts."""

    def __init__(self, sampler: Sampler, grammars: SequenceGrammars | None, *, vocab_size: int,
                 banned: Callable[[Any, int, bool], tuple[int, ...]]) -> None:
        """``banned(seq, num_output_tokens, grammar_complete)``: the token ids a row may not take."""
        self.sampler = sampler
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.banned = banned

    def sample(self, logits: torch.Tensor, seq_ids: Sequence[str], sequences: dict[str, Any],
               drafts: dict[str, tuple[int, ...]]) -> tuple[SampledTokens, tuple[AcceptedDrafts, ...]]:
        """``seq_ids``: each logits row's sequence (a verifying one's rows consecutive)."""
        groups: list[tuple[str, tuple[int, ...], int]] = []
        row = 0
        while row < len(seq_ids):
            proposed = drafts.get(seq_ids[row], ())
            groups.append((seq_ids[row], proposed, row))
            row += len(proposed) + 1
        completes = self._constrain_(logits, groups)
        rows = []
        for (seq_id, proposed, _), complete in zip(groups, completes, strict=True):
            seq = sequences[seq_id]
            for i in range(len(proposed) + 1):
                output = seq.output_token_ids if i == 0 else [*seq.output_token_ids, *proposed[:i]]
                rows.append(SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                                        output_token_ids=output,
                                        banned_token_ids=self.banned(seq, len(output), complete[i])))
        batch = SamplingBatch.build(rows, vocab_size=self.vocab_size, device=logits.device)
        verified = verify(self.sampler, logits, batch,
                          [DraftRows(first_row=first, drafts=proposed) for _, proposed, first in groups])
        sampled_token_ids, sampled_logprobs, accepted = [], [], []
        for (seq_id, _, _), result in zip(groups, verified, strict=True):
            seq = sequences[seq_id]
            tokens = result.token_ids
            logprobs: tuple = (None,) * len(tokens)
            if seq.params.logprobs is not None:
                logprobs = tuple(compute_logprobs(logits[list(result.rows)], tokens, seq.params.logprobs))
            seq.output_token_ids.extend(tokens)
            if self.grammars is not None and seq_id in self.grammars:
                for token_id in tokens:
                    self.grammars.accept(seq_id, token_id)
            sampled_token_ids.append(tokens[-1])
            sampled_logprobs.append(logprobs[-1])
            if len(tokens) > 1:
                accepted.append(AcceptedDrafts(seq_id, tokens[:-1], logprobs[:-1] if seq.params.logprobs is not None
                                               else ()))
        asked = any(entry is not None for entry in sampled_logprobs)
        return (SampledTokens(tuple(seq_id for seq_id, _, _ in groups), tuple(sampled_token_ids),
                              tuple(sampled_logprobs) if asked else ()), tuple(accepted))

    def _constrain_(self, logits: torch.Tensor, groups) -> list[list[bool]]:
        """Masks the rows of the sequences that follow a grammar, in place; returns, for every
        sequence's rows, whether its grammar is complete there."""
        grammars = self.grammars
        completes, masked, masks = [], [], []
        for seq_id, proposed, first in groups:
            if grammars is None or seq_id not in grammars:
                completes.append([False] * (len(proposed) + 1))
                continue
            bitmask, complete = grammars.allowed_tokens_along(seq_id, proposed)
            completes.append(complete)
            masked.extend(range(first, first + len(proposed) + 1))
            masks.append(bitmask)
        if masks:
            index = None if len(masked) == logits.shape[0] else torch.tensor(masked, device=logits.device)
            apply_allowed_tokens_(logits, index, torch.cat(masks))
        return completes
