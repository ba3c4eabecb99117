"""Unit tests: speculative decoding's parts on their own: the configuration's checks, prompt
lookup's index, the policy's choice of how many tokens to propose, and the rejection sampler
against its definition (greedy: exact prefix matching; random: the emitted tokens'
distribution is the target's, by a chi-squared test with a stated false-alarm rate)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError
from triode.engine.sampling_params import SamplingParams
from triode.engine.spec_decode.config import SpeculativeConfig
from triode.engine.spec_decode.ngram import NgramIndex
from triode.engine.spec_decode.policy import tokens_worth_proposing
from triode.engine.worker.rejection import DraftRows, verify
from triode.engine.worker.sampler import Sampler
from triode.engine.worker.sampling_batch import SamplingBatch, SamplingRow

CPU = torch.device("cpu")

# ---- configuration ---------------------------------------------------------------------------


def test_ngram_config_takes_vllms_json_and_defaults():
    args = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    config = args.speculative_config
    assert config is not None
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    assert SpeculativeConfig(method="[ngram]", num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(model="/draft", num_speculative_tokens=2).method == "draft_model"
    assert EngineArgs.from_env({"TRIODE_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 3}'}
                               ).speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


@pytest.mark.parametrize("value, names", [
    ({"method": "lookahead", "num_speculative_tokens": 2}, "method"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "trained speculator head"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ("{not json", "not JSON"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(value, names):
    with pytest.raises(InvalidRequestError, match=names) as caught:
        EngineArgs(speculative_config=value)
    assert caught.value.field == "speculative_config"


# ---- prompt lookup ---------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_latest_match():
    index = NgramIndex(2, 4, [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 8, 1, 2, 3])
    # suffix (1, 2, 3) occurs at 0..3 (followed by 9) ; (2, 3) alone later, followed by 4
    assert index.propose(3) == (9, 9, 7)
    index.extend([4])
    assert index.propose(2) == (5, 6)  # (2, 3, 4) then 5, 6
    assert index.propose(0) == ()
    assert NgramIndex(2, 3, [1, 2, 3, 4]).propose(4) == ()  # the suffix occurs nowhere before
    assert NgramIndex(1, 1, [5, 6, 5]).propose(4) == (6, 5)  # up to the end of the text


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), low=st.integers(1, 3), extra=st.integers(0, 2),
       k=st.integers(1, 5))
def test_ngram_matches_a_scan_of_the_text(tokens, low, extra, k):
    high = low + extra
    index = NgramIndex(low, high)
    for token in tokens:
        index.extend([token])
    # the reference: longest n in [low, high], then the latest earlier end, candidates bounded alike
    expected = ()
    n_tokens = len(tokens)
    for n in range(high, low - 1, -1):
        if n_tokens <= n:
            continue
        suffix = tokens[n_tokens - n:]
        ends = [end for end in range(n, n_tokens) if tokens[end - n:end] == suffix]
        low_ends = [end for end in range(low, n_tokens) if tokens[end - low:end] == tokens[n_tokens - low:]]
        if ends and ends[-1] in low_ends[-32:]:
            expected = tuple(tokens[ends[-1]:ends[-1] + k])
            break
    assert index.propose(k) == expected


# ---- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize("acceptance, row_cost, expected", [
    (1.0, 0.35, 6), (0.9, 0.35, 4), (0.5, 0.35, 1), (0.3, 0.35, 0), (0.5, 0.05, 3), (0.0, 0.05, 0),
])
def test_tokens_worth_proposing_maximizes_tokens_per_cost(acceptance, row_cost, expected):
    assert tokens_worth_proposing(acceptance, 6, row_cost) == expected


# ---- the rejection sampler -------------------------------------------------------------------


def _batch(rows: int, params: SamplingParams, vocab: int) -> SamplingBatch:
    return SamplingBatch.build([SamplingRow(params=params)] * rows, vocab_size=vocab, device=CPU)


def test_greedy_verification_keeps_the_proposals_the_argmax_agrees_with():
    vocab = 8
    argmax = [3, 5, 1, 7]
    logits = torch.full((len(argmax), vocab), -1.0)
    for row, token in enumerate(argmax):
        logits[row, token] = 2.0
    batch = _batch(len(argmax), SamplingParams(temperature=0.0), vocab)
    sampler = Sampler(0)
    for drafts, expected in [((3, 5, 1), (3, 5, 1, 7)), ((3, 5, 2), (3, 5, 1)), ((4, 5, 1), (3,)),
                             ((3,), (3, 5))]:
        rows = [DraftRows(first_row=0, drafts=drafts)]
        if len(drafts) < 3:  # the rows after this sequence's are another, proposing nothing
            rows += [DraftRows(first_row=r) for r in range(len(drafts) + 1, len(argmax))]
        result = verify(sampler, logits.clone(), batch, rows)
        assert len(result) == len(rows)
        assert result[0].token_ids == expected
        assert result[0].rows == tuple(range(len(expected)))


def _chi_squared_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chance of a statistic at least this large if ``counts`` were drawn from ``probs``
    (cells with expected count below 5 are merged into one, as the test requires)."""
    total = counts.sum()
    expected = probs * total
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    counts, expected = counts[keep], expected[keep]
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = max(len(counts) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic.double() / 2))


# Each example's test falsely fails with probability 1e-6, so the 40 examples of the two tests
# below together with probability under 1e-4; the draws come from fixed seeds, so a run that
# passes passes every time.
FALSE_ALARM = 1e-6
DRAWS = 4000


@settings(max_examples=20, deadline=None, derandomize=True)
@given(data=st.data(), vocab=st.integers(2, 8), with_draft_probs=st.booleans())
def test_verified_tokens_are_distributed_as_the_target(data, vocab, with_draft_probs):
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    target = torch.randn(2, vocab, generator=generator) * 2  # rows: after the token, after the proposal
    params = SamplingParams(temperature=1.0)
    if with_draft_probs:  # a draft model's distribution, proposals drawn from it
        q = torch.softmax(torch.randn(vocab, generator=generator) * 2, dim=-1)
        drafts = torch.multinomial(q, DRAWS, replacement=True, generator=generator).tolist()
    else:  # a certain proposer (prompt lookup): one fixed token
        q = None
        drafts = [data.draw(st.integers(0, vocab - 1))] * DRAWS
    logits = target.repeat(DRAWS, 1)
    rows = [DraftRows(first_row=2 * i, drafts=(d,), draft_probs=None if q is None else q[None])
            for i, d in enumerate(drafts)]
    results = verify(Sampler(data.draw(st.integers(0, 1000))), logits, _batch(2 * DRAWS, params, vocab), rows)
    assert len(results) == DRAWS
    first = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=vocab).double()
    assert _chi_squared_p_value(first, torch.softmax(target[0].double(), -1)) > FALSE_ALARM
    # after an accepted proposal, the next token comes from the row after it
    second = [r.token_ids[1] for r in results if r.num_accepted == 1]
    if len(second) >= 200:
        counts = torch.bincount(torch.tensor(second), minlength=vocab).double()
        assert _chi_squared_p_value(counts, torch.softmax(target[1].double(), -1)) > FALSE_ALARM


def test_seeded_verification_repeats_and_a_row_without_proposals_samples_as_the_sampler():
    vocab = 16
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(params=SamplingParams(temperature=1.0, seed=7), output_token_ids=[1] * i) for i in range(6)]
    batch = SamplingBatch.build(rows, vocab_size=vocab, device=CPU)
    groups = [DraftRows(first_row=0, drafts=(2, 3)), DraftRows(first_row=3), DraftRows(first_row=4, drafts=(5,))]
    first = verify(Sampler(0), logits.clone(), batch, groups)
    again = verify(Sampler(99), logits.clone(), batch, groups)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert first[1].token_ids == (Sampler(5).sample(logits.clone(), batch).token_ids[3],)
