"""One sequence's state as the scheduler sees it: tokens, progress, KV blocks, status.

A user request with ``n > 1`` becomes ``n`` sequences (see ``make_sequences``) that share the
prompt. Each sequence is a ``Sequence`` here; ``request_id`` and ``index`` map it back to the
user's request and its output slot. The sequences share the prompt's KV blocks through the
prefix cache: the scheduler admits the first one, and keeps its siblings waiting while that one
computes the prompt; once the prompt's full blocks are cached, each sibling's
``BlockManager.get_computed_blocks`` returns those same block ids, so they end up in every
sibling's block table with a reference count of ``n``. Only the last, partial prompt block (and
at least one token, so that logits exist) is computed again per sibling.
"""

from __future__ import annotations

import collections.abc
import enum
from typing import TYPE_CHECKING

import attrs

from triode.engine.errors import InvalidRequestError
from triode.engine.lora.request import LoRARequest
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from triode.engine.spec_decode.policy import SpeculationState
    from triode.engine.worker_messages import TokenLogprobs

_INT64_MIN = -(2**63)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds KV blocks; the worker knows it
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed from scratch
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or the model's max length
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the client

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` string, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """Mutable state of one sequence; owned by the scheduler, never shared across actors."""

    # Slots: the scheduler reads these attributes for every sequence of every step.
    __slots__ = (
        "all_token_ids", "arrival_time", "block_hashes", "block_ids", "cache_salt",
        "draft_token_ids", "eos_token_ids", "incarnation", "index", "known_to_worker", "lora",
        "max_model_len", "max_num_tokens", "num_blocks_sent", "num_cached_blocks",
        "num_cached_tokens", "num_computed_tokens", "num_in_flight_samples",
        "num_in_flight_tokens", "num_output_reported", "num_prompt_logprobs_sent",
        "num_prompt_tokens", "num_released_blocks", "order", "params", "pooling", "priority",
        "prompt_token_ids", "reports_at_end", "request_id", "seq_id", "speculation", "status",
        "stop_reason"
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: collections.abc.Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float,
        max_model_len: int,
        eos_token_ids: collections.abc.Sequence[int] = (),
        priority: int = 0,
        request_id: str | None = None,
        index: int = 0,
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        if len(prompt_token_ids) > max_model_len:
            raise InvalidRequestError(
                f"prompt: {len(prompt_token_ids)} tokens is longer than the model's maximum "
                f"length of {max_model_len} tokens",
                field="prompt",
            )
        self.seq_id = seq_id  # unique among live sequences
        self.request_id = seq_id if request_id is None else request_id  # the user's request id
        self.index = index  # which of the parent's n outputs this is
        self.params = params
        self.pooling = pooling  # a pooling sequence: its one "sample" is its embedding
        self.lora = lora  # the adapter it runs with, or None for the base model
        # The prefix cache's first parent hash: KV computed with an adapter is that adapter's.
        self.cache_salt = b"" if lora is None else b"lora:%d" % lora.lora_int_id
        self.arrival_time = arrival_time  # given by the caller: the core never reads a clock
        self.priority = priority  # lower value = more important (vLLM's convention)
        # The model's end-of-sequence ids, its own first (see check_stop).
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # The whole history (prompt + output): prefix hashing and recompute read from it.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # A prompt of exactly max_model_len tokens still gets one token (as in vLLM): positions
        # fed to the model stay below max_model_len since the last sampled token is never fed.
        limit = max(max_model_len, self.num_prompt_tokens + 1)
        max_new = limit if params.max_tokens is None else params.max_tokens
        self.max_num_tokens = min(self.num_prompt_tokens + max_new, limit)

        # KV-cache state, reset by preemption (recompute).
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (including prefix hits)
        # Of the steps planned but not yet come back (async scheduling): the tokens they feed,
        # and the tokens they sample, which the next plan feeds before they are known.
        self.num_in_flight_tokens = 0
        self.num_in_flight_samples = 0
        # Bumped by every reset: a result for an earlier incarnation of the sequence is ignored.
        self.incarnation = 0
        self.block_ids: list[int] = []  # the block table
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_released_blocks = 0  # leading blocks freed as outside every layer's window
        self.num_cached_tokens = 0  # prefix-cache hit of the first admission (usage stats)
        # Hashes of the full blocks of all_token_ids, extended lazily by the block manager;
        # they depend on tokens only, so they survive preemption.
        self.block_hashes: list[bytes] = []
        # Worker-sync state: the worker knows this sequence, and the first num_blocks_sent
        # entries of its block table.
        self.known_to_worker = False
        self.num_blocks_sent = 0
        self.num_prompt_logprobs_sent = 0  # so a recompute does not repeat prompt logprobs
        # A final-only request's sequence with nothing to find in its text (no stop strings) and
        # no logprobs reports its first token (the output side stamps the time) and then the
        # rest at its end: the output side had nothing to do with the tokens between
        # (``LLM.generate``'s, non-streamed HTTP responses'; 0.3 ms a step at 256 sequences on
        # this project's 2-core Xeon).
        self.reports_at_end = (
            pooling is None and params.output_kind == OutputKind.FINAL_ONLY and not params.stop
            and params.logprobs is None and params.prompt_logprobs is None
        )
        self.num_output_reported = 0  # of a sequence that reports at its end
        # Speculative decoding: the tokens the workers proposed to follow all_token_ids (the
        # next step verifies them), and the record that decides how many to ask for.
        self.draft_token_ids: tuple[int, ...] = ()
        self.speculation: SpeculationState | None = None
        self.order = 0  # insertion counter, set by the scheduler: the last tie-breaker

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens whose KV is computed or being computed by a step in flight."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    def num_to_feed(self, limit: int) -> int:
        """The tokens to feed this running sequence now, at most ``limit``: the rest of those it
        has (with the one a step in flight samples), or none if that step ends it by length."""
        # Plain attributes rather than the properties: this runs for every sequence of every step.
        pending = self.num_in_flight_samples
        num_tokens = len(self.all_token_ids)
        if pending and num_tokens + pending >= self.max_num_tokens:
            return 0
        left = num_tokens + pending - self.num_computed_tokens - self.num_in_flight_tokens
        return left if left < limit else limit

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> SequenceStatus | None:
        """Stop checks that need only token ids, after a token was appended: the finished status
        to give the sequence (the scheduler applies it), setting stop_reason, or None. Stop
        strings are the detokenizer's job (they need text). A stop token on the last allowed
        position reports "stop", not "length": the model ended on its own.

        Every end-of-sequence id stops, as in Hugging Face and vLLM. The model's own (the first
        of ``eos_token_ids``) leaves stop_reason None; any other sets it to the id, which is
        what vLLM reports for the extra ids of generation_config.json (Llama 3's
        ``<|eom_id|>`` and ``<|eot_id|>`` can be told apart that way)."""
        params, token_ids = self.params, self.all_token_ids
        num_tokens = len(token_ids)
        if num_tokens - self.num_prompt_tokens >= params.min_tokens:
            last = token_ids[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                if last != self.eos_token_ids[0]:
                    self.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return SequenceStatus.FINISHED_STOPPED
        if num_tokens >= self.max_num_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def take_unreported_tokens(self) -> tuple[int, ...]:
        """The output tokens not yet reported (see ``reports_at_end``), now marked reported."""
        start = self.num_prompt_tokens + self.num_output_reported
        self.num_output_reported = len(self.all_token_ids) - self.num_prompt_tokens
        return tuple(self.all_token_ids[start:])

    def unsent_prompt_logprobs(
        self, start: int, entries: tuple[TokenLogprobs, ...]
    ) -> tuple[TokenLogprobs, ...]:
        """The prompt logprobs of a chunk fed at ``start`` (entry i is for prompt token
        ``start + 1 + i``) that were not reported before a recompute; marks them reported."""
        if not entries:
            return ()
        skip = max(0, self.num_prompt_logprobs_sent - start)
        self.num_prompt_logprobs_sent = max(self.num_prompt_logprobs_sent, start + len(entries))
        return tuple(entries[skip:])

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks this sequence holds a reference to: its block table but the leading ones
        released behind a sliding window (whose ids may since hold another position's KV)."""
        return self.block_ids[self.num_released_blocks:]

    def reset_for_recompute(self) -> None:
        """Forgets the KV cache (preemption or worker restart). The caller frees the blocks."""
        self.status = SequenceStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_in_flight_samples = 0
        self.incarnation += 1
        self.block_ids = []
        self.num_cached_blocks = 0
        self.num_released_blocks = 0
        self.known_to_worker = False
        self.num_blocks_sent = 0
        self.draft_token_ids = ()


# The sampling side of a pooling sequence: one step past its prompt, which is its embedding.
POOLING_SAMPLING = SamplingParams(max_tokens=1)


def make_sequences(
    request_id: str,
    prompt_token_ids: collections.abc.Sequence[int],
    params: SamplingParams | PoolingParams,
    *,
    arrival_time: float,
    max_model_len: int,
    eos_token_ids: collections.abc.Sequence[int] = (),
    priority: int = 0,
    lora: LoRARequest | None = None,
) -> list[Sequence]:
    """The sequences of one user request: itself when ``n == 1`` (or it pools), else ``n``
    children with ids ``"{request_id}-{i}"``, ``n=1`` params, and ``seed + i`` (wrapped to
    int64) so seeded parallel samples differ yet stay reproducible, as in vLLM."""
    if isinstance(params, PoolingParams):
        return [Sequence(request_id, prompt_token_ids, POOLING_SAMPLING, arrival_time=arrival_time,
                         max_model_len=max_model_len, priority=priority, pooling=params)]
    if params.n == 1:
        return [
            Sequence(
                request_id, prompt_token_ids, params, arrival_time=arrival_time,
                max_model_len=max_model_len, eos_token_ids=eos_token_ids, priority=priority, lora=lora,
            )
        ]
    children = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed = (seed + i - _INT64_MIN) % 2**64 + _INT64_MIN
        children.append(
            Sequence(
                f"{request_id}-{i}", prompt_token_ids, attrs.evolve(params, n=1, seed=seed),
                arrival_time=arrival_time, max_model_len=max_model_len,
                eos_token_ids=eos_token_ids, priority=priority, request_id=request_id, index=i, lora=lora,
            )
        )
    return children
