"""Paged KV blocks: reference counts, a free queue, and the prefix cache.

A block holds ``block_size`` consecutive token positions of one or more sequences. A *full*
block whose KV has been computed is registered under a hash chained from its parent block's
hash and its own token ids, so two sequences share a block only when their whole prefixes up to
and including that block are identical. Blocks are registered only after the step that computed
them came back (``cache_computed_blocks``), never at allocation: a hit therefore always points
at KV that exists, and no worker has to order writes and reads of one block within a step.

Free blocks wait in one queue, evicted from the front: blocks that hold nothing reusable go to
the front, freed cached blocks go to the back (least recently used first) and keep their hash
until the block is handed out again, so a finished conversation's prefix can still be hit.

With ``record_events`` the manager also keeps what happened to the cache as vLLM's KV-cache
events (``triode.engine.core.kv_cache_events``), taken by ``take_events``: every hash that
enters ``cached`` and every hash that leaves it, in order.

When every layer of the model has a sliding window, a running sequence's blocks that lie wholly
before the window of its next query are freed as it advances (``release_outside_window``); their
ids stay in its block table, where the attention kernels never read them again.
"""

from __future__ import annotations

import collections.abc
import hashlib
import struct
from collections import OrderedDict

from triode.engine.core.kv_cache_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from triode.engine.core.sequence import Sequence


def hash_block(parent_hash: bytes, token_ids: collections.abc.Sequence[int]) -> bytes:
    """A 128-bit digest: collisions are negligible, and stable across processes and runs."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent_hash + data, digest_size=16).digest()


def blocks_in_use_at_most(num_tokens: int, block_size: int, *, sliding_window: int | None, max_chunk: int) -> int:
    """The most blocks a sequence of ``num_tokens`` positions holds at once, computing up to
    ``max_chunk`` tokens a step: all of them, or with a sliding window on every layer the
    window and a chunk (and a block on either side of their edges)."""
    whole = -(-num_tokens // block_size)
    if sliding_window is None:
        return whole
    return min(whole, -(-(sliding_window - 1 + max_chunk) // block_size) + 1)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
        sliding_window: int | None = None, record_events: bool = False,
    ):
        """``sliding_window``: the model's window when every layer has one (a query at position
        i reads keys i - window < j <= i), else None."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window ({sliding_window}) must be >= 1 or None")
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id, for computed full blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queries = 0  # in tokens, like vLLM
        self.prefix_cache_hits = 0
        # None: not recorded (no publisher), so the cache's hot paths pay one test.
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events = self._events
        if not events:  # most steps change no cached block: nothing to allocate
            return []
        self._events = []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses, including cached ones that may still be evicted."""
        return len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """Extends seq.block_hashes over its full blocks (tokens never change, only grow)."""
        hashes, tokens, size = seq.block_hashes, seq.all_token_ids, self.block_size
        for i in range(len(hashes), len(tokens) // size):
            hashes.append(hash_block(hashes[-1] if i else seq.cache_salt, tokens[i * size : (i + 1) * size]))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest run of cached full blocks that starts the sequence's tokens, and how many
        tokens they cover. Never the whole history: the last token must be computed so that
        the step produces logits. Pure: nothing changes until ``allocate_slots`` takes them."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need every prompt position computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in self._hashes(seq)[:max_blocks]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: collections.abc.Sequence[int] = ()
    ) -> list[int] | None:
        """Makes room for ``num_new_tokens`` after the computed ones and those of steps in
        flight, first taking the prefix hits ``computed_blocks`` (only for a sequence that holds
        no blocks). Returns the block ids appended to the block table, or None, changing
        nothing, when too few blocks are free."""
        if computed_blocks:
            assert not seq.block_ids and seq.num_computed_tokens == 0
        elif seq.num_scheduled_tokens + num_new_tokens <= len(seq.block_ids) * self.block_size:
            return []  # most decode steps: the last block has room
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = self.blocks_for(seq.num_scheduled_tokens + num_hit_tokens + num_new_tokens)
        num_fresh = max(0, total - len(seq.block_ids) - len(computed_blocks))
        # A hit on a free cached block takes it out of the free queue as well.
        num_revived = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        if num_fresh + num_revived > len(self.free_queue):
            return None
        if not seq.block_ids and self.enable_prefix_caching:
            # Counted on admission only, so a sequence that waits for blocks is counted once.
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        new_blocks = list(computed_blocks)
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1
        for _ in range(num_fresh):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            new_blocks.append(block_id)
        seq.block_ids.extend(new_blocks)
        if computed_blocks:
            seq.num_computed_tokens = num_hit_tokens
            seq.num_cached_blocks = len(computed_blocks)
        return new_blocks

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.cached.get(block_hash) == block_id:
                del self.cached[block_hash]
                if self._events is not None:
                    self._events.append(BlockRemoved((block_hash,)))

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Registers the sequence's full blocks whose KV is now computed (call after a step)."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if not self.enable_prefix_caching or num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq)
        stored = []
        for i in range(seq.num_cached_blocks, num_full):
            block_id, block_hash = seq.block_ids[i], hashes[i]
            # Another sequence may have computed the same block in the same step: keep the
            # first copy, this one stays unregistered and is recycled when freed.
            if self.block_hash[block_id] is None and block_hash not in self.cached:
                self.block_hash[block_id] = block_hash
                self.cached[block_hash] = block_id
                stored.append(i)
        if self._events is not None and stored:
            self._events.extend(self._stored_runs(seq, hashes, stored))
        seq.num_cached_blocks = num_full

    def _stored_runs(self, seq: Sequence, hashes: list[bytes], stored: list[int]) -> list[BlockStored]:
        """One BlockStored per run of consecutive blocks (indices ``stored``) newly in the cache."""
        size, tokens = self.block_size, seq.all_token_ids
        runs, start = [], 0
        for k in range(1, len(stored) + 1):
            if k == len(stored) or stored[k] != stored[k - 1] + 1:
                first, last = stored[start], stored[k - 1]
                runs.append(BlockStored(
                    tuple(hashes[first:last + 1]), hashes[first - 1] if first else None,
                    tuple(tokens[first * size:(last + 1) * size]), size,
                    None if seq.lora is None else seq.lora.lora_int_id, None if seq.lora is None else seq.lora.lora_name,
                ))
                start = k
        return runs

    def blocks_in_use_at_most(self, num_tokens: int, max_chunk: int) -> int:
        """See :func:`blocks_in_use_at_most`."""
        return blocks_in_use_at_most(num_tokens, self.block_size, sliding_window=self.sliding_window,
                                     max_chunk=max_chunk)

    def release_outside_window(self, seq: Sequence) -> None:
        """With a sliding window on every layer: frees the sequence's leading blocks that its
        next query (at position num_computed_tokens) and every later one can no longer see."""
        if self.sliding_window is None:
            return
        first_visible = max(0, seq.num_computed_tokens - self.sliding_window + 1)
        dead = min(first_visible // self.block_size, len(seq.block_ids))
        for block_id in seq.block_ids[seq.num_released_blocks:dead]:
            self._release(block_id)
        seq.num_released_blocks = max(seq.num_released_blocks, dead)

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free_queue[block_id] = None
            if self.block_hash[block_id] is None:
                self.free_queue.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def free(self, seq: Sequence) -> None:
        """Drops the sequence's references (finish, abort, preemption). Tail blocks are queued
        before head blocks, so a shared prefix outlives the tail of one conversation."""
        for block_id in reversed(seq.held_block_ids):
            self._release(block_id)
        seq.block_ids = []
        seq.num_released_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (after a worker restart the KV they named is gone; a user
        may ask for it, as in vLLM). Only while every block is free: a running sequence's next
        full blocks would be registered under parents the cache no longer holds. Returns
        whether it reset; False changes nothing."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block_id in reversed(self.free_queue.copy()):
            if self.block_hash[block_id] is not None:
                self.free_queue.move_to_end(block_id, last=False)  # holds nothing to keep now
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True
