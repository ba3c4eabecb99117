"""Unit tests: the paged KV block manager (triode.engine.core.kv_blocks): reference counts, the free
queue, prefix-cache hashing, hits and least-recently-used eviction, and the blocks released
behind a sliding window."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triode.engine.core.kv_blocks import BlockManager, hash_block
from triode.engine.core.kv_cache_events import AllBlocksCleared
from triode.engine.core.sequence import Sequence
from triode.engine.sampling_params import SamplingParams


def request(tokens: list[int], request_id: str = "r", **params) -> Sequence:
    return Sequence(
        request_id, tokens, SamplingParams(**params), arrival_time=0.0, max_model_len=1000
    )


def compute(bm: BlockManager, req: Sequence, num_tokens: int | None = None) -> list[int]:
    """Admits a request like the scheduler does (hits, then its whole history in one step) and
    registers its full blocks as if the step ran."""
    hits, num_hit = bm.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_tokens is None else num_tokens
    new = bm.allocate_slots(req, num_new, hits)
    assert new is not None
    req.num_computed_tokens = num_hit + num_new
    bm.cache_computed_blocks(req)
    return new


def check_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for req in live:
        for block in req.held_block_ids:
            refs[block] += 1
    assert refs == bm.ref_counts
    assert set(bm.free_queue) == {b for b, n in enumerate(refs) if n == 0}
    assert bm.num_free_blocks == refs.count(0)
    for block_hash, block in bm.cached.items():
        assert bm.block_hash[block] == block_hash


def test_hash_is_chained_from_the_parent():
    first = hash_block(b"", [1, 2])
    assert first == hash_block(b"", [1, 2]) and len(first) == 16
    assert hash_block(first, [3, 4]) != hash_block(hash_block(b"", [9, 9]), [3, 4])
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1])


def test_hit_reuses_full_blocks_but_never_the_last_token():
    bm = BlockManager(8, 2)
    a = request([1, 2, 3, 4, 5])
    compute(bm, a)
    assert len(bm.cached) == 2  # [1, 2] and [3, 4]; the partial [5] is not cached
    same = request([1, 2, 3, 4], "same")  # two full blocks: the last token must be computed
    assert bm.get_computed_blocks(same) == (a.block_ids[:1], 2)
    longer = request([1, 2, 3, 4, 6, 7], "longer")
    assert bm.get_computed_blocks(longer) == (a.block_ids[:2], 4)
    other = request([1, 9, 3, 4, 5], "other")
    assert bm.get_computed_blocks(other) == ([], 0)
    # Queries and hits count on admission only.
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (5, 0)
    new = compute(bm, longer)
    assert new[:2] == a.block_ids[:2] and len(new) == 3
    assert [bm.ref_counts[b] for b in a.block_ids] == [2, 2, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (11, 4)
    assert longer.num_computed_tokens == 6 and longer.num_cached_blocks == 3
    check_consistent(bm, [a, longer])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, 2)
    a = request([1, 2, 3])
    compute(bm, a)
    b = request([1, 2, 5, 6, 7], "b")
    hits, num_hit = bm.get_computed_blocks(b)
    assert num_hit == 2
    # b needs its hit plus two fresh blocks, one is free.
    assert bm.allocate_slots(b, 3, hits) is None
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert bm.num_free_blocks == 1 and bm.prefix_cache_queries == 3
    check_consistent(bm, [a])


def test_decode_allocates_only_at_block_boundaries():
    bm = BlockManager(4, 2)
    a = request([1, 2, 3])
    compute(bm, a)
    a.append_output_token(4)
    assert bm.allocate_slots(a, 1) == []  # position 3 fits the second block
    a.num_computed_tokens += 1
    a.append_output_token(5)
    assert len(bm.allocate_slots(a, 1)) == 1  # position 4 needs a third
    check_consistent(bm, [a])


def test_free_keeps_cached_blocks_and_evicts_lru_with_blank_blocks_first():
    bm = BlockManager(6, 2)
    a = request([1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] cached, [5] blank
    compute(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 2
    b = request([7] * 9, "b")  # five blocks: the three never used, a's blank one, and ...
    compute(bm, b)
    assert a_blocks[2] in b.block_ids  # blank blocks go before cached ones
    assert a_blocks[1] in b.block_ids  # then the least recently used: a's tail before its head
    assert a_blocks[0] not in b.block_ids
    assert bm.get_computed_blocks(request([1, 2, 3, 4, 5], "c")) == (a_blocks[:1], 2)
    check_consistent(bm, [b])


def test_a_hit_on_a_free_cached_block_takes_it_from_the_free_queue():
    bm = BlockManager(4, 2)
    a = request([1, 2, 3])
    compute(bm, a)
    bm.free(a)
    b = request([1, 2, 9], "b")
    compute(bm, b)
    assert bm.ref_counts[b.block_ids[0]] == 1 and b.block_ids[0] not in bm.free_queue
    check_consistent(bm, [b])


def test_double_free_is_caught():
    bm = BlockManager(4, 2)
    a = request([1, 2, 3])
    compute(bm, a)
    blocks = list(a.block_ids)
    bm.free(a)
    a.block_ids = blocks
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_disabled_prefix_caching_never_hits_or_counts():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = request([1, 2, 3, 4, 5])
    compute(bm, a)
    assert not bm.cached
    assert bm.get_computed_blocks(request([1, 2, 3, 4, 5], "b")) == ([], 0)
    assert bm.prefix_cache_queries == 0


def test_prompt_logprobs_requests_skip_the_cache():
    bm = BlockManager(8, 2)
    compute(bm, request([1, 2, 3]))
    assert bm.get_computed_blocks(request([1, 2, 3], "b", prompt_logprobs=1)) == ([], 0)


def test_reset_prefix_cache_only_while_every_block_is_free():
    bm = BlockManager(4, 2, record_events=True)
    a = request([1, 2, 3])
    compute(bm, a)
    bm.take_events()
    assert bm.reset_prefix_cache() is False  # a holds blocks: nothing changes
    assert bm.get_computed_blocks(request([1, 2, 3], "b"))[1] == 2
    assert bm.take_events() == []
    bm.free(a)
    assert bm.reset_prefix_cache() is True
    assert not bm.cached and bm.get_computed_blocks(request([1, 2, 3], "b")) == ([], 0)
    assert bm.take_events() == [AllBlocksCleared()]


def test_after_a_reset_the_blocks_that_were_cached_are_handed_out_first():
    """They hold nothing worth keeping any more, and their memory has been written already."""
    bm = BlockManager(8, 2)
    a = request([1, 2, 3, 4, 5])
    cached = compute(bm, a)[:2]  # two full blocks, and a partial one that is never cached
    bm.free(a)
    assert list(bm.free_queue)[-2:] == cached[::-1]  # kept as long as possible
    assert bm.reset_prefix_cache()
    assert list(bm.free_queue)[:2] == cached[::-1]


@settings(max_examples=100, deadline=None)
@given(
    block_size=st.integers(1, 4),
    num_blocks=st.integers(4, 16),
    caching=st.booleans(),
    seed=st.integers(0, 2**16),
    num_ops=st.integers(1, 60),
)
def test_random_admissions_share_only_identical_prefixes(
    block_size, num_blocks, caching, seed, num_ops
):
    bm = BlockManager(num_blocks, block_size, caching)
    rng = random.Random(seed)
    content: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix it was computed for
    live: list[Sequence] = []
    for op in range(num_ops):
        if live and rng.random() < 0.4:
            req = live.pop(rng.randrange(len(live)))
            bm.free(req)
        else:
            tokens = [rng.randrange(1, 3) for _ in range(rng.randrange(1, 3 * block_size + 2))]
            req = request(tokens, f"r{op}")
            hits, num_hit = bm.get_computed_blocks(req)
            assert num_hit < req.num_tokens
            for i, block in enumerate(hits):
                assert content[block] == tuple(tokens[: (i + 1) * block_size])
            if bm.allocate_slots(req, req.num_tokens - num_hit, hits) is None:
                assert req.block_ids == []
                continue
            req.num_computed_tokens = req.num_tokens
            for i, block in enumerate(req.block_ids[len(hits) :], start=len(hits)):
                content[block] = tuple(tokens[: (i + 1) * block_size])  # the "worker" writes
            bm.cache_computed_blocks(req)
            live.append(req)
        check_consistent(bm, live)
    for req in live:
        bm.free(req)
    assert bm.num_free_blocks == num_blocks and not any(bm.ref_counts)


def test_blocks_behind_the_window_are_released_as_a_sequence_advances():
    bm = BlockManager(8, 4, sliding_window=6)
    a = request(list(range(10)))
    compute(bm, a)  # the next query (position 10) sees 5..10: block 0 (0..3) is dead
    first = a.block_ids[0]
    bm.release_outside_window(a)
    assert a.num_released_blocks == 1 and bm.ref_counts[first] == 0
    assert next(reversed(bm.free_queue)) == first  # cached: kept for a hit, evicted last
    check_consistent(bm, [a])
    bm.release_outside_window(a)  # nothing new behind the window: nothing released twice
    check_consistent(bm, [a])
    a.append_output_token(10)
    assert bm.allocate_slots(a, 1) == []  # position 10 lies in block 2, already held
    a.num_computed_tokens = 11
    bm.release_outside_window(a)  # position 11 sees 6..11: block 1 (4..7) still needed
    assert a.num_released_blocks == 1
    # A second sequence with the same first block hits it although a released it.
    b = request([0, 1, 2, 3, 99, 98], "b")
    assert bm.get_computed_blocks(b) == ([first], 4)
    compute(bm, b)
    assert b.block_ids[0] == first and bm.ref_counts[first] == 1
    check_consistent(bm, [a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and a.num_released_blocks == 0
    check_consistent(bm, [])


def test_a_window_bounds_the_blocks_a_sequence_holds():
    assert BlockManager(100, 4).blocks_in_use_at_most(1000, 8) == 250
    # 5 earlier keys, a chunk of 8: 13 positions over at most 5 blocks
    assert BlockManager(100, 4, sliding_window=6).blocks_in_use_at_most(1000, 8) == 5
    assert BlockManager(100, 4, sliding_window=6).blocks_in_use_at_most(7, 8) == 2
