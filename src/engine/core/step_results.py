"""A step's result applied to the sequences it was planned for: computed tokens advance, newly
full blocks are cached, sampled tokens are appended and the token-id stop checks run.

Sequence state advances only here, when a result arrives, in plan order; so a lost step leaves
nothing half-applied. A sequence that finished, was aborted or was preempted while its step
ran has that step's work ignored: its ``incarnation`` tells a recomputed sequence from the one
planned for.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from triode.engine.core.scheduler_output import SequenceUpdate
from triode.engine.core.sequence import Sequence, SequenceStatus
from triode.engine.core.sequence_queues import SequenceQueues
from triode.engine.spec_decode.policy import SpeculationPolicy
from triode.engine.spec_decode.scheduling import apply_verified
from triode.engine.worker_messages import StepResult

logger = logging.getLogger(__name__)


class PlannedChunk(NamedTuple):  # a sequence's share of a step out: a tuple is the cheapest record
    seq: Sequence
    incarnation: int
    start: int
    num_tokens: int
    sample: bool
    num_drafts: int  # of num_tokens, proposed tokens to verify


def apply_step_result(queues: SequenceQueues, speculation: SpeculationPolicy | None, result: StepResult,
                      planned: dict[str, PlannedChunk]) -> list[SequenceUpdate]:
    """Applies ``result`` to the sequences of the step it answers (``planned``, by seq id);
    those it finishes leave the queues. Returns an update for each sequence that sampled, or
    received prompt logprobs."""
    sampled = result.sampled
    token_ids = dict(zip(sampled.seq_ids, sampled.token_ids, strict=True))
    token_logprobs = dict(zip(sampled.seq_ids, sampled.logprobs, strict=True)) if sampled.logprobs else {}
    accepted = {entry.seq_id: entry for entry in result.accepted}
    proposals = dict(result.proposals)
    pooled = dict(result.pooled)
    prompt_logprobs = dict(result.prompt_logprobs)
    # This loop runs for every sequence of every step: what it can, it looks up once.
    bm = queues.block_manager
    cache_blocks = bm.cache_computed_blocks if bm.enable_prefix_caching else None
    block_size = bm.block_size
    release_blocks = bm.release_outside_window if bm.sliding_window is not None else None
    sequences = queues.sequences
    updates = []
    for seq_id, step in planned.items():
        seq = step.seq
        if sequences.get(seq_id) is not seq or seq.incarnation != step.incarnation:
            continue  # finished, aborted or preempted after the plan was made
        seq.num_computed_tokens += step.num_tokens - step.num_drafts
        seq.num_in_flight_tokens -= step.num_tokens
        # a verified chunk's blocks: once its accepted tokens are appended (apply_verified);
        # the test before the call skips it for the steps that fill no block
        if cache_blocks is not None and not step.num_drafts and \
                seq.num_computed_tokens >= (seq.num_cached_blocks + 1) * block_size:
            cache_blocks(seq)
        if release_blocks is not None and not step.num_drafts:
            release_blocks(seq)
        plp = seq.unsent_prompt_logprobs(step.start, prompt_logprobs[seq_id]) if seq_id in prompt_logprobs else ()
        if not step.sample:
            if plp:
                updates.append(SequenceUpdate(seq_id, seq.request_id, seq.index, (), (), plp,
                                              None, None, seq.num_cached_tokens))
            continue
        seq.num_in_flight_samples -= 1
        if seq.pooling is not None:  # its prompt has run: its embedding is its result
            if seq_id not in pooled:
                raise RuntimeError(f"step {result.step_id} pooled nothing for {seq_id!r}")
            queues.retire(seq, SequenceStatus.FINISHED_STOPPED)
            updates.append(SequenceUpdate(seq_id, seq.request_id, seq.index, finish_reason="stop",
                                          num_cached_tokens=seq.num_cached_tokens, embedding=pooled[seq_id]))
            continue
        token_id = token_ids.get(seq_id)
        if token_id is None:
            raise RuntimeError(f"step {result.step_id} sampled no token for {seq_id!r}")
        if step.num_drafts:
            assert speculation is not None
            new_ids, logprobs, status = apply_verified(speculation, bm, seq, step.num_drafts,
                                                       accepted.get(seq_id), token_id, token_logprobs.get(seq_id))
        else:
            seq.all_token_ids.append(token_id)  # append_output_token, without the call
            status = seq.check_stop()
            new_ids, logprobs = (token_id,), (token_logprobs.get(seq_id),)
        if status is not None:
            queues.retire(seq, status)
        elif seq_id in proposals:
            seq.draft_token_ids = proposals[seq_id]
        if seq.reports_at_end:
            if status is None and seq.num_output_reported:
                continue  # the output side learns of this token at the end
            new_ids = seq.take_unreported_tokens()
        updates.append(tuple.__new__(SequenceUpdate, (  # every field: see worker_messages.records
            seq_id, seq.request_id, seq.index, new_ids,
            logprobs if seq.params.logprobs is not None else (), plp,
            None if status is None else status.finish_reason,
            None if status is None else seq.stop_reason, seq.num_cached_tokens, None,
        )))
    return updates


def abort_failed_adapters(queues: SequenceQueues, failed: dict[int, str]) -> list[SequenceUpdate]:
    """Ends every sequence of adapters the workers could not read (their files changed
    since the engine checked them), each with a final "abort" update."""
    ended = [(seq, seq.lora) for seq in queues.sequences.values()
             if seq.lora is not None and seq.lora.lora_int_id in failed]
    for seq, lora in ended:
        logger.error("LoRA adapter %r could not be read by the workers (%s): request %r aborted",
                     lora.lora_name, failed[lora.lora_int_id], seq.request_id)
    queues.abort([seq.seq_id for seq, _ in ended])
    return [SequenceUpdate(seq.seq_id, seq.request_id, seq.index, unreported_tokens(seq), finish_reason="abort",
                           num_cached_tokens=seq.num_cached_tokens) for seq, _ in ended]


def unreported_tokens(seq: Sequence) -> tuple[int, ...]:
    """The tokens of a sequence that reports at its end (``Sequence.reports_at_end``) that the
    output side has not seen, now marked seen; () for the others, which report every token."""
    return seq.take_unreported_tokens() if seq.reports_at_end else ()
