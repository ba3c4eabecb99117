"""The scheduler's speculative steps: which proposed tokens a decode feeds to be verified, which
sampling chunks ask for proposals, and what a verified chunk appends.

A sampling chunk may ask the workers to propose tokens to follow what it samples
(``ScheduledChunk.propose``, as many as the policy finds worth it); the next step feeds them
after the sequence's token (``num_draft_tokens``), and the result says which the target
accepted (``StepResult.accepted``): the sequence grows by those and the token sampled after
them, and only their KV counts as computed. The number of tokens a speculating step emits is
unknown until its result, so no step is planned ahead of one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from triode.engine.spec_decode.policy import SpeculationPolicy, SpeculationState

if TYPE_CHECKING:
    from triode.engine.core.kv_blocks import BlockManager
    from triode.engine.core.sequence import Sequence, SequenceStatus
    from triode.engine.worker_messages import (
        AcceptedDrafts,
        ScheduledChunk,
        TokenLogprobs,
    )


def drafts_to_verify(seq: Sequence, budget: int) -> tuple[int, ...]:
    """The proposed tokens a decode feeds after its token, taken from the sequence: as many as
    the budget and the tokens it may still emit leave room for (one more always comes with
    them)."""
    drafts, seq.draft_token_ids = seq.draft_token_ids, ()
    if seq.num_in_flight_samples:  # cannot happen: no step is planned ahead of a proposal
        return ()
    return drafts[:max(0, min(budget, seq.max_num_tokens - len(seq.all_token_ids) - 1))]


def ask_for_proposals(policy: SpeculationPolicy, chunks: dict[str, ScheduledChunk],
                      sequences: dict[str, Sequence], num_running: int) -> None:
    """Marks the sampling chunks whose sequences should propose tokens for their next step."""
    if not policy.batch_speculates(num_running):
        return
    for seq_id, chunk in chunks.items():
        if not chunk.sample:
            continue
        seq = sequences[seq_id]
        # the step emits at least one token; the next one at least one more
        room = seq.max_num_tokens - len(seq.all_token_ids) - seq.num_in_flight_samples - 1
        if seq.speculation is None:
            seq.speculation = SpeculationState()
        if k := policy.tokens_to_propose(seq.speculation, room):
            chunks[seq_id] = chunk._replace(propose=k)


def apply_verified(
    policy: SpeculationPolicy, block_manager: BlockManager, seq: Sequence, num_drafts: int,
    accepted: AcceptedDrafts | None, token_id: int, token_logprobs: TokenLogprobs | None,
) -> tuple[tuple[int, ...], tuple[TokenLogprobs | None, ...], SequenceStatus | None]:
    """Appends a verified chunk's accepted tokens and the one sampled after them
    (``token_id``, with ``token_logprobs``), up to a stop; their KV, but the last token's, is
    now computed. Returns (tokens, logprobs, finished status or None)."""
    ids = (*accepted.token_ids, token_id) if accepted else (token_id,)
    # (the accepted tokens' logprobs are empty where the request asked for none; unread then)
    logprobs = (*accepted.logprobs, token_logprobs) if accepted else (token_logprobs,)
    assert seq.speculation is not None
    policy.record(seq.speculation, num_drafts, len(ids) - 1)
    status = None
    kept = 0
    for token_id in ids:
        seq.append_output_token(token_id)
        kept += 1
        if (status := seq.check_stop()) is not None:
            break
    seq.num_computed_tokens += kept - 1
    if block_manager.enable_prefix_caching:
        block_manager.cache_computed_blocks(seq)
    if block_manager.sliding_window is not None:
        block_manager.release_outside_window(seq)
    return ids[:kept], logprobs[:kept], status
