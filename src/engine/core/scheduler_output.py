"""What the scheduler hands out: per-step updates of each sequence, and its statistics."""

from __future__ import annotations

from typing import NamedTuple

import attrs

from triode.engine.spec_decode.policy import SpecDecodeStats
from triode.engine.worker_messages import TokenLogprobs


class SequenceUpdate(NamedTuple):
    """What one step did to one sequence, for the output side (detokenizer, streams). A named
    tuple: there is one per sequence and step."""

    seq_id: str
    request_id: str  # the user's request id (the parent of an n > 1 sequence)
    index: int  # type: ignore[assignment]  # which of the parent's n outputs (vLLM's name; shadows tuple.index)
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()  # one per new token, when requested
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # for prompt tokens this step computed
    finish_reason: str | None = None  # "stop" / "length" once finished by a token-id check
    stop_reason: int | str | None = None  # the stop token id that ended it (None for EOS)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: tuple[float, ...] | None = None  # a pooling sequence's, when its prompt has run


# Upper bounds of the tokens-per-step histogram (vLLM's vllm:iteration_tokens_total buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@attrs.frozen(kw_only=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Steps planned by tokens fed, per bucket of ITERATION_TOKEN_BUCKETS (not cumulative; the
    # last count is above every bound), and the tokens of them all.
    iteration_tokens: tuple[int, ...] = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    iteration_tokens_sum: int = 0
    # The adapters of the running and the waiting sequences, by name (vllm:lora_requests_info).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    spec_decode: SpecDecodeStats | None = None  # with a speculative config
