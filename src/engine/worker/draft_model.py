"""The draft-model proposer: a smaller model of the target's vocabulary, loaded in rank 0's
worker, proposing its greedy tokens after each step for the sequences the plan marks.

Its KV cache is its own: paged like the target's, sized from its share of
``kv_cache_memory`` (``draft_kv_share``), with blocks handed out here as sequences grow and
freed when the worker forgets a sequence. It remembers the tokens whose KV it holds for each
sequence; after a verification the part that the target rejected is dropped, and the next
proposal first feeds what it has not seen (the whole history the first time, in one prefill;
then the accepted tokens and the target's own) before decoding its proposals one step at a
time, every proposing sequence in one batch. Greedy proposals are certain (a point mass), so
the rejection sampler needs nothing more from it to keep the output exact."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from triode.engine.config import EngineArgs
from triode.engine.errors import KVCacheTooSmallError
from triode.engine.model.config import ModelConfig
from triode.engine.model_files.layout import load_hf_config
from triode.engine.spec_decode.config import MAX_SPECULATIVE_TOKENS
from triode.engine.worker.block_tables import BlockTables
from triode.engine.worker.checkpoint import iter_safetensors, quantized_tensors
from triode.engine.worker.host_memory import zeroed_tensor
from triode.engine.worker.kv_pages import kv_pages_for
from triode.engine.worker.models.registry import build_model
from triode.engine.worker.placement import kept_quantized
from triode.engine.worker.step_inputs import StepInputs
from triode.engine.worker_messages import ScheduledChunk

# (seq id, prompt token ids, output token ids, tokens wanted): what a proposer is asked
ProposalRequest = tuple[str, Sequence[int], Sequence[int], int]

logger = logging.getLogger(__name__)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_heads: int | None = None) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * (config.num_kv_heads if kv_heads is None else kv_heads) * config.head_dim * element


def draft_config(args: EngineArgs) -> ModelConfig | None:
    spec = args.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    assert spec.model is not None
    path = Path(spec.model)
    return ModelConfig.from_hf(load_hf_config(path), source=str(path / "config.json"))


def draft_kv_share(args: EngineArgs, target_bytes_per_token: int, dtype: torch.dtype) -> float:
    """The part of ``kv_cache_memory`` the draft model's cache takes: as many tokens as the
    target's (every sequence the target holds may propose)."""
    config = draft_config(args)
    if config is None:
        return 0.0
    draft = kv_bytes_per_token(config, dtype)
    return draft / (draft + target_bytes_per_token)


class DraftModelProposer:
    def __init__(self, args: EngineArgs, *, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 budget_bytes: int, block_size: int) -> None:
        spec = args.speculative_config
        assert spec is not None and spec.model is not None
        path = Path(spec.model)
        config = draft_config(args)
        assert config is not None
        self.config = config
        self.device = device
        self.block_size = block_size
        max_positions = max_model_len + MAX_SPECULATIVE_TOKENS
        quantized = kept_quantized(quantized_tensors(path), args, device)
        self.model = build_model(config, iter_safetensors(path), dtype=dtype, device=device,
                                 max_positions=max_positions, source=str(path), quantized=quantized)
        per_block = block_size * kv_bytes_per_token(config, dtype)
        self.num_blocks = budget_bytes // per_block
        max_blocks = -(-max_positions // block_size)
        if self.num_blocks < max_blocks:
            raise KVCacheTooSmallError(
                f"speculative_config: the draft model's share of the KV-cache budget ({budget_bytes} bytes) holds "
                f"{self.num_blocks * block_size} tokens, fewer than one sequence of max_model_len={max_model_len} "
                f"and its proposals (raise kv_cache_memory, lower max_model_len or take a smaller draft model)")
        shape = (self.num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [(zeroed_tensor(shape, dtype, device), zeroed_tensor(shape, dtype, device))
                          for _ in range(config.num_layers)]
        self.tables = BlockTables(max_blocks, rows=args.max_num_seqs)
        # never-used blocks leave _free in increasing order, as the block manager's do
        self._pages = kv_pages_for(self.kv_caches)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._blocks: dict[str, list[int]] = {}
        self._fed: dict[str, list[int]] = {}  # per sequence, the tokens whose KV the draft holds
        logger.info("draft model %s: %d layers, KV cache of %d tokens", path, config.num_layers,
                    self.num_blocks * block_size)

    def forget(self, seq_id: str) -> None:
        self._free.extend(self._blocks.pop(seq_id, ()))
        self._fed.pop(seq_id, None)
        self.tables.remove(seq_id)

    def _room(self, seq_id: str, positions: int) -> bool:
        """Blocks for ``positions`` positions of a sequence, taken if free; False if not."""
        blocks = self._blocks.setdefault(seq_id, [])
        if seq_id not in self.tables:
            self.tables.add(seq_id)
        wanted = -(-positions // self.block_size) - len(blocks)
        if wanted > len(self._free):
            return False
        if wanted > 0:
            new = [self._free.pop() for _ in range(wanted)]
            blocks.extend(new)
            self.tables.extend(seq_id, new)
        return True

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[tuple[int, ...]]:
        """Up to ``k`` greedy tokens after each sequence's tokens; none for a sequence whose
        proposals would not fit the draft's cache."""
        active = []
        for seq_id, prompt, output, k in requests:
            tokens = [*prompt, *output]
            fed = self._fed.setdefault(seq_id, [])
            keep = 0
            for old, new in zip(fed, tokens, strict=False):  # the rejected tail's KV is stale
                if old != new:
                    break
                keep += 1
            del fed[keep:]
            if keep == len(tokens):  # the last token must be fed again for its logits
                del fed[-1:]
            if self._room(seq_id, len(tokens) + k - 1):
                active.append((seq_id, tokens, k))
        proposals: dict[str, list[int]] = {request[0]: [] for request in requests}
        # the unseen tokens of each sequence, then one proposal at a time
        chunks = [(seq_id, tuple(tokens[len(self._fed[seq_id]):]), len(self._fed[seq_id]))
                  for seq_id, tokens, _ in active]
        wanted = {seq_id: k for seq_id, _, k in active}
        if self._pages is not None:
            self._pages.commit_through(self.tables.highest_block)
        step = 0
        while chunks:
            chunks.sort(key=lambda chunk: len(chunk[1]) != 1)  # decodes first, as the inputs need
            scheduled = [ScheduledChunk(seq_id, fed, start) for seq_id, fed, start in chunks]
            inputs = StepInputs.build(scheduled, [c[1] for c in chunks], self.tables, block_size=self.block_size,
                                      device=self.device)
            hidden = self.model(inputs.token_ids, inputs.positions, self.kv_caches, inputs.metadata)
            rows = torch.tensor(inputs.last_token_rows, device=self.device)
            tokens = self.model.compute_logits(hidden.index_select(0, rows)).argmax(dim=-1).tolist()
            step += 1
            following = []
            for (seq_id, fed, start), token in zip(chunks, tokens, strict=True):
                self._fed[seq_id].extend(fed)
                proposals[seq_id].append(token)
                if step < wanted[seq_id]:
                    following.append((seq_id, (token,), start + len(fed)))
            chunks = following
        return [tuple(proposals[request[0]]) for request in requests]
