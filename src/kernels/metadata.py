"""What the attention ops need to know about a flattened step batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """A step's batch as the attention ops see it.

    Sequences are ordered decodes first (one query token each), then prefill chunks. Sequence
    ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]`` and has ``seq_lens[i]``
    tokens in the KV cache once this step's keys are written; its new tokens are the last
    ones, so a chunk attends causally to itself and fully to the cached prefix before it.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so that CPU code can loop over sequences without device syncs.
    query_start_loc_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
