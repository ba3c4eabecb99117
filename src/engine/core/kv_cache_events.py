"""What happened to the prefix cache, as vLLM's KV-cache events name it.

The block manager records these when asked to (``BlockManager(record_events=True)``): a run of
full blocks registered after the step that computed them (``BlockStored``), a cached block
handed out again (``BlockRemoved``), the whole cache forgotten after a worker restart
(``AllBlocksCleared``). The engine core hands them to the driver's publisher after every
step; a router that applies them in order holds the same set of cached block hashes as the
engine. Sans-IO: how they travel is ``triode.engine.kv_events``' business."""

from __future__ import annotations

from typing import NamedTuple


class BlockStored(NamedTuple):
    """Full blocks of one sequence newly in the cache, in order: each hash chains from the one
    before it, the first from ``parent_block_hash`` (None when it is the sequence's first block)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]  # the blocks' tokens, block_size per hash
    block_size: int
    lora_id: int | None = None  # the adapter whose KV they hold (None: the base model's)
    lora_name: str | None = None


class BlockRemoved(NamedTuple):
    block_hashes: tuple[bytes, ...]


class AllBlocksCleared(NamedTuple):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
