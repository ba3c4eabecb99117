"""When a sequence speculates, and how far: the scheduler's side of speculative decoding.

Verifying k proposed tokens costs a step k more rows; it pays only while enough of them are
accepted. Each sequence keeps decayed counts of its accepted tokens and its rejections, whose
ratio estimates the chance ``a`` that the next proposed token is accepted; the number asked
for is the k that maximizes the tokens a step emits, ``(1 - a^(k+1)) / (1 - a)``, over what
it costs, ``1 + row_cost * k`` (a decode step's cost is 1; ``row_cost`` is the device's,
measured in docs/benchmarks.md). A sequence whose proposals are rejected stops asking and
tries again after a pause that doubles each time it fails again (up to ``MAX_PAUSE`` steps),
so free text costs a probe now and then, never a verify step per token. No sequence
speculates while more than ``disable_by_batch_size`` run: a batch that large is already as
cheap per token as verification would make it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from triode.engine.config import EngineArgs

# A verified token's share of a step's cost against a plain decode step (row_cost above): on a
# CPU, a few more rows of the default model's step (docs/benchmarks.md, "Speculative
# decoding"); on a GPU a step's weights are read once for every row.
CPU_ROW_COST = 0.35
GPU_ROW_COST = 0.05
DECAY = 0.7  # weight of the history against one new verification
MIN_PAUSE = 4
MAX_PAUSE = 64


@attrs.frozen(kw_only=True)
class SpecDecodeStats:
    """Counters since start, as vLLM's ``vllm:spec_decode_*`` metrics: verifications with at
    least one proposed token, the tokens proposed and accepted, and the acceptances by
    position (entry i: how often the (i+1)-th proposed token was accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification: the accepted ones and the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@attrs.define
class SpeculationState:
    """One sequence's record (decayed counts, starting as if two proposals were accepted)."""

    accepted: float = 2.0
    rejected: float = 0.0
    pause: int = MIN_PAUSE  # the next pause's length
    paused_for: int = 0  # steps left in the current one
    probing: bool = False


def tokens_worth_proposing(acceptance: float, limit: int, row_cost: float) -> int:
    """The k in 0..limit with the most tokens emitted per unit of step cost."""
    best, best_rate = 0, 1.0
    emitted = 1.0
    for k in range(1, limit + 1):
        emitted += acceptance ** k
        rate = emitted / (1 + row_cost * k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class SpeculationPolicy:
    def __init__(self, *, num_speculative_tokens: int, disable_by_batch_size: int, row_cost: float) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.row_cost = row_cost
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted = 0
        self._accepted_per_position = [0] * num_speculative_tokens

    def batch_speculates(self, num_running: int) -> bool:
        return num_running <= self.disable_by_batch_size

    def tokens_to_propose(self, state: SpeculationState, room: int) -> int:
        """Proposed tokens to ask for a sequence's next step; ``room``: tokens it may still
        emit beyond the one a step always gives."""
        limit = min(self.num_speculative_tokens, room)
        if limit <= 0:
            return 0
        if state.paused_for:
            state.paused_for -= 1
            if state.paused_for == 0:
                state.probing = True
            return 0
        if state.probing:
            return 1
        k = tokens_worth_proposing(state.accepted / (state.accepted + state.rejected), limit, self.row_cost)
        if k == 0:
            state.paused_for, state.pause = state.pause, min(2 * state.pause, MAX_PAUSE)
        return k

    def record(self, state: SpeculationState, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` tokens (at least one) accepted the first ``accepted``."""
        state.accepted = DECAY * state.accepted + accepted
        state.rejected = DECAY * state.rejected + (accepted < proposed)
        if state.probing:
            state.probing = False
            if accepted == proposed:
                state.pause = MIN_PAUSE
            else:
                state.paused_for, state.pause = state.pause, min(2 * state.pause, MAX_PAUSE)
        self._num_drafts += 1
        self._num_draft_tokens += proposed
        self._num_accepted += accepted
        for position in range(accepted):
            self._accepted_per_position[position] += 1

    def statistics(self) -> SpecDecodeStats:
        return SpecDecodeStats(num_drafts=self._num_drafts, num_draft_tokens=self._num_draft_tokens,
                               num_accepted_tokens=self._num_accepted,
                               accepted_per_position=tuple(self._accepted_per_position))


def speculation_policy(args: EngineArgs, worker_device: str) -> SpeculationPolicy | None:
    """The policy of an engine with a speculative config, for workers on ``worker_device``."""
    config = args.speculative_config
    if config is None:
        return None
    assert config.num_speculative_tokens is not None
    gpu = worker_device.startswith("cuda")
    return SpeculationPolicy(num_speculative_tokens=config.num_speculative_tokens,
                             disable_by_batch_size=config.resolved_disable_by_batch_size(worker_device),
                             row_cost=GPU_ROW_COST if gpu else CPU_ROW_COST)
