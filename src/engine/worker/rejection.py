"""Speculative decoding's verification: which proposed tokens the target model keeps, and the
token it adds, so that the output is distributed exactly as without speculation.

A verified sequence has one sampling row per proposed token plus one: row i holds the
target's distribution p_i after the sequence's tokens and the first i proposals. Proposal
d_(i+1) is kept with probability min(1, p_i(d) / q_i(d)), where q_i is the proposer's
distribution (a point mass for prompt lookup, whose proposals are certain: then p_i(d));
at the first rejection the token comes from the residual max(p_i - q_i, 0), renormalized;
after the last proposal it comes from p_k itself. Every token so emitted has the target's
distribution (Leviathan et al., 2023; Chen et al., 2023). A greedy row's distribution is a
point mass on its argmax: a proposal is kept when it is the argmax, so the output is token for
token the one plain decoding gives.

The rows are drawn as ``Sampler.sample`` would draw them (the same processing, noise and
seeds), so a row without proposals, or one after every proposal was kept, gets the very token
the sampler would give it; the acceptance draws are separate uniforms (``Sampler.uniforms``).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from triode import kernels
from triode.engine.worker.sampler import Sampler
from triode.engine.worker.sampling_batch import SamplingBatch


@attrs.frozen(kw_only=True, eq=False)
class DraftRows:
    """One sequence's rows in a sampling batch: ``first_row`` and one more per proposed token.
    ``draft_probs`` [len(drafts), V]: the proposer's distributions, None for a certain one."""

    first_row: int
    drafts: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None


@attrs.frozen(kw_only=True)
class Verified:
    """A sequence's emitted tokens (the kept proposals, then the target's own) and the rows
    they were sampled at (for their logprobs)."""

    token_ids: tuple[int, ...]
    rows: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch,
           sequences: Sequence[DraftRows]) -> list[Verified]:
    """Each sequence's tokens from ``logits`` [B, V] (processed as the batch says, e.g. already
    masked by grammars); ``sequences`` cover the batch's rows, in order."""
    draws = sampler.draw(logits, batch, keep_distributions=True)
    tokens = draws.token_ids.tolist()
    random_rows = batch.random_rows.tolist() if batch.random_rows is not None else []
    position = {row: index for index, row in enumerate(random_rows)}
    # the random rows that test a proposal each get one uniform draw
    tested = [position[seq.first_row + i] for seq in sequences for i in range(len(seq.drafts))
              if seq.first_row + i in position]
    uniforms = dict(zip(tested, sampler.uniforms(batch, tested, logits.device), strict=True))
    results = []
    for seq in sequences:
        kept: list[int] = []
        for i, draft in enumerate(seq.drafts):
            row = seq.first_row + i
            if row not in position:  # greedy: keep the argmax
                if tokens[row] != draft:
                    break
            else:
                assert draws.probs is not None
                p = draws.probs[position[row], draft].item()
                q = 1.0 if seq.draft_probs is None else seq.draft_probs[i, draft].item()
                if uniforms[position[row]] * q >= p:
                    break
            kept.append(draft)
        last = seq.first_row + len(kept)
        if len(kept) < len(seq.drafts) and last in position:
            token = _residual_draw(draws, position[last], seq.drafts[len(kept)],
                                   None if seq.draft_probs is None else seq.draft_probs[len(kept)])
        else:
            token = tokens[last]
        results.append(Verified(token_ids=(*kept, token), rows=tuple(range(seq.first_row, last + 1))))
    return results


def _residual_draw(draws, position: int, rejected: int, draft_probs: torch.Tensor | None) -> int:
    """A draw from max(p - q, 0) renormalized, by the row's own race (its noise is independent
    of the acceptance draw that rejected the proposal)."""
    assert draws.probs is not None and draws.noise is not None
    p = draws.probs[position]
    if draft_probs is None:
        residual = p.clone()
        residual[rejected] = 0.0
    else:
        residual = (p - draft_probs.to(p.dtype)).clamp_min_(0.0)
    if not bool(residual.gt(0).any()):  # p == q up to rounding: nothing left to prefer
        residual = p
    return int(kernels.argmax((residual / draws.noise[position])[None])[0])
