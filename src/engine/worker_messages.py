"""What the engine process and the worker processes send each other: the worker's facts after
a load (``WorkerInfo``), and each step's plan and result.

A plan carries only what changed since the previous step: the worker keeps each sequence's
token history and block table, so nothing grows with the length of a conversation. Every
message is pickled on each step, so they hold plain Python values, never tensors, and this
module imports neither torch nor trio: both sides import it, and the engine process stays
free of torch through it. A plan's chunks (``ScheduledChunk``) are named tuples that travel
as columns (a tuple per field): at 64 sequences a plan then pickles and unpickles in about 33
us, where records as attrs classes took 274 (measured on this project's 2-core CPU). A
result's sampled tokens are columns from the start (``SampledTokens``).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

import attrs

from triode.engine.lora.request import LoRARequest
from triode.engine.pooling_params import PoolingParams
from triode.engine.sampling_params import SamplingParams

# The step channel's framing (triode.engine.actors.step_channel, triode.engine.worker.step_server): a
# message is its pickle's length in 8 little-endian bytes, then the pickle.
STEP_FRAME = struct.Struct("<Q")

_Record = TypeVar("_Record", bound=tuple[Any, ...])


def records(cls: type[_Record], rows: Iterable[tuple[Any, ...]]) -> tuple[_Record, ...]:
    """Named tuples of ``cls`` from rows that hold every field, defaults included. Built by
    ``tuple.__new__``, as the hot paths build single records too: a named tuple's own
    constructor is Python code (0.34 us a record against 0.13 on this project's CPU), and there
    are several records per sequence and step."""
    return tuple(map(functools.partial(tuple.__new__, cls), rows))


@attrs.frozen(kw_only=True)
class NewSequence:
    """A sequence the worker has not seen, or one that restarts after preemption or a worker
    restart (its KV cache is gone, so ``token_ids`` holds everything to recompute)."""

    seq_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()  # tokens already sampled before a recompute
    params: SamplingParams
    # The model's end-of-sequence ids, banned with the stop token ids until min_tokens are
    # out (the engine reads them from config.json and generation_config.json).
    eos_token_ids: tuple[int, ...] = ()
    # A pooling sequence: its last chunk returns its embedding, and it samples nothing.
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None  # the adapter it runs with (the worker reads its files once)


class ScheduledChunk(NamedTuple):
    """The work for one sequence in one step: ``token_ids`` are fed at positions
    ``start_position ..``; ``new_block_ids`` extend its block table first. A named tuple:
    there is one per sequence and step, and tuples are the cheapest records to build and to
    pickle."""

    seq_id: str
    token_ids: tuple[int, ...]
    start_position: int
    new_block_ids: tuple[int, ...] = ()
    sample: bool = True  # False for a prefill chunk that does not reach the end of the prompt
    # Async scheduling: one more input token after ``token_ids``, the one the step before
    # samples for this sequence. The engine sends the plan before it knows that token; the
    # worker, which sampled it and runs steps in plan order, feeds it.
    sampled_input: bool = False
    # Speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are proposed tokens
    # to verify (the chunk samples after each of them, and keeps what the target accepts);
    # ``propose``: after sampling, propose up to this many tokens for the next step.
    num_draft_tokens: int = 0
    propose: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.sampled_input


@attrs.frozen(kw_only=True)
class StepPlan:
    step_id: int
    new_sequences: tuple[NewSequence, ...] = ()
    chunks: tuple[ScheduledChunk, ...] = ()
    finished_seq_ids: tuple[str, ...] = ()  # forget these before running the step
    # LoRA adapters to read into host memory in the background (sequences of theirs wait
    # until a result lists them in ``loaded_loras``)
    load_loras: tuple[LoRARequest, ...] = ()
    # A plan without chunks, sent while adapters are being read: it returns once one is read
    # (or after a short wait), so that an engine with nothing else to run learns of it.
    wait_for_loads: bool = False

    def __reduce__(self) -> tuple[Callable[..., StepPlan], tuple[Any, ...]]:
        return _plan_from_columns, (self.step_id, self.new_sequences, self.finished_seq_ids,
                                    tuple(zip(*self.chunks, strict=True)), self.load_loras, self.wait_for_loads)


def _plan_from_columns(step_id: int, new_sequences: tuple[NewSequence, ...], finished_seq_ids: tuple[str, ...],
                       columns: tuple[tuple[Any, ...], ...], load_loras: tuple[LoRARequest, ...],
                       wait_for_loads: bool) -> StepPlan:
    chunks = records(ScheduledChunk, zip(*columns, strict=True))
    return StepPlan(step_id=step_id, new_sequences=new_sequences, chunks=chunks, finished_seq_ids=finished_seq_ids,
                    load_loras=load_loras, wait_for_loads=wait_for_loads)


@attrs.frozen(kw_only=True)
class TokenLogprobs:
    """Logprobs for one position: the chosen token and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()


class SampledTokens(NamedTuple):
    """The token each sampling sequence of a step got, as columns (one entry per sequence):
    the worker has them so, the result pickles them as they are, and the engine reads them
    through one dict, where a record per sequence took building, taking apart and building
    again (0.1-0.13 ms a step at 256 sequences on this project's 2-core CPU)."""

    seq_ids: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    # one per entry (None where the request asked for none); empty when no request asked
    logprobs: tuple[TokenLogprobs | None, ...] = ()


class AcceptedDrafts(NamedTuple):
    """A verified chunk's proposed tokens that the target model accepted, in order; the token
    it sampled after them is the chunk's entry in ``SampledTokens``. Only chunks that accepted
    some."""

    seq_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]  # one per token where the request asked for logprobs, else ()


class Proposal(NamedTuple):
    """Tokens proposed to follow a sequence's sampled token (``ScheduledChunk.propose``)."""

    seq_id: str
    token_ids: tuple[int, ...]


class PooledOutput(NamedTuple):
    """A pooling sequence's embedding (as floats: results are pickled, never tensors)."""

    seq_id: str
    embedding: tuple[float, ...]


@attrs.frozen(kw_only=True)
class StepResult:
    step_id: int
    sampled: SampledTokens = attrs.Factory(SampledTokens)
    # seq_id -> logprobs of prompt tokens 1.. computed in this step's chunk
    prompt_logprobs: tuple[tuple[str, tuple[TokenLogprobs, ...]], ...] = ()
    pooled: tuple[PooledOutput, ...] = ()  # the pooling sequences whose prompt this step ended
    accepted: tuple[AcceptedDrafts, ...] = ()
    proposals: tuple[Proposal, ...] = ()
    # LoRA adapters (by id) the worker has read into host memory since its last result, and
    # those it dropped from there (its --max-cpu-loras), or could not read (id, reason)
    loaded_loras: tuple[int, ...] = ()
    evicted_loras: tuple[int, ...] = ()
    failed_loras: tuple[tuple[int, str], ...] = ()
    execute_seconds: float = 0.0
    collective_seconds: float = 0.0  # of execute_seconds, in tensor-parallel collectives
    grammar_seconds: float = 0.0  # of execute_seconds, following grammars and masking logits
    # of execute_seconds, host work around the forward: applying the plan, building the step's
    # inputs and the sampler's tensors (what `triode bench step --overhead` reports)
    prepare_seconds: float = 0.0
    forward_seconds: float = 0.0  # of execute_seconds, the model's forward (and its logits)
    sample_seconds: float = 0.0  # of execute_seconds, sampling (and verifying proposals)
    # Filled in by the worker group from every rank's result (rank order); empty for one rank.
    rank_execute_seconds: tuple[float, ...] = ()
    rank_collective_seconds: tuple[float, ...] = ()


@attrs.frozen(kw_only=True)
class WorkerInfo:
    """What the engine learns from a freshly loaded worker."""

    pid: int
    num_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_memory_bytes: int = 0  # this rank's KV budget, given or sized from its memory
    kv_cache_sizing: str = ""  # how that budget was chosen, for the start-up log
    vocab_size: int
    dtype: str
    device: str
    load_seconds: float
    rank: int = 0
    tensor_parallel_size: int = 1
    kv_heads: int = 0  # KV heads this rank holds (all of them at size 1)
    kv_window: int | None = None  # the sliding window when every layer of the model has one
    runner: str = "generate"  # or "pooling": the model embeds, and samples nothing
    hidden_size: int = 0  # a pooling model's embedding size
    whole_prompts: bool = False  # an encoder: each prompt runs whole, in one step
    # VmHWM (peak resident set) of the worker process: before the load (imports only), once
    # the weights were loaded, and after the KV cache was allocated too.
    baseline_rss_bytes: int | None = None
    weights_peak_rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
