"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

One implementation: the four differ only in attention biases (Qwen2), per-head q/k RMSNorm
(Qwen3), head_dim and rope scaling, all read from ModelConfig. q/k/v and gate/up are fused
into one matmul each; their weights are concatenated at load time.

Tensor parallelism (``parallel`` given): the same modules hold one rank's shard, as
``engine.worker.distributed.Partition`` assigns it: q/k/v and gate/up are column-parallel
(their rows split), o_proj and down_proj row-parallel (columns split, then an all-reduce;
their biases live on rank 0 only), the embedding and LM head vocabulary-parallel (masked
lookup + all-reduce; partial logits gathered on rank 0). ``checkpoint_slices`` tells the
loader which slice of each checkpoint tensor a rank reads. Without ``parallel`` nothing of
this runs: no collective, no mask, the single-rank forward is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

import kernels
from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.worker.distributed import Partition, TensorParallelGroup
from engine.worker.models.rope import cos_sin_cache

KVCache = tuple[torch.Tensor, torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear through ``kernels.linear``; on a CPU, :meth:`pack` (once the weight is loaded)
    gives it oneDNN's packed copy of the weight."""

    packed_weight: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed_weight = kernels.pack_linear_weight(self.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, self.packed_weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        partition = parallel.partition if parallel is not None else None
        self.num_heads = partition.num_q_heads if partition else config.num_heads
        self.num_kv_heads = partition.num_kv_heads if partition else config.num_kv_heads
        self.parallel = parallel
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: kernels.AttentionMetadata,
        rope_cache: torch.Tensor,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, _ = self.q_norm(q)
            k, _ = self.k_norm(k)
        kernels.rotary_embedding(positions, q, k, rope_cache)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = kernels.paged_attention(q, k, v, k_cache, v_cache, metadata, self.scale)
        out = self.o_proj(out.reshape(tokens, -1))
        if self.parallel is not None:
            self.parallel.all_reduce(out)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        size = parallel.partition.intermediate_size if parallel else config.intermediate_size
        self.size = size
        self.parallel = parallel
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))
        if self.parallel is not None:
            self.parallel.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, parallel)
        self.mlp = MLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        if residual is None:
            residual = hidden
            hidden, _ = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    # Hugging Face parameter name fragment -> (our fused parameter, shard index)
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, *, max_positions: int, parallel: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        vocab = parallel.partition.vocab_size if parallel else config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, parallel) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, vocab, bias=False)
        )
        self.max_positions = max_positions
        self.tied_head_packed: torch.Tensor | None = None
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)

    def pack_linear_weights(self) -> None:
        """Packs every linear weight for ``kernels.linear`` (on a CPU; elsewhere nothing is
        packed). Call after the weights are loaded: a later change to them is not seen."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.lm_head is None:
            self.tied_head_packed = kernels.pack_linear_weight(self.embed_tokens.weight.detach())

    def init_rope(self) -> None:
        config = self.config
        self.rope_cache = cos_sin_cache(
            config.head_dim, config.rope_theta, config.rope_scaling, self.max_positions,
            self.embed_tokens.weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: kernels.AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a flattened step batch."""
        hidden = self.embed_tokens(input_ids) if self.parallel is None else self._embed_shard(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, self.rope_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Vocabulary-parallel: rows of ids outside this rank's range are zero, the sum over the
        # ranks is the full lookup.
        start, stop = self.parallel.partition.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= stop - start)
        hidden = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.embed_tokens.weight)
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.parallel.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab]. Under tensor parallelism every rank must call it (it
        gathers the vocabulary shards); rank 0 gets the logits, the other ranks None."""
        if self.lm_head is None:
            logits = kernels.linear(hidden, self.embed_tokens.weight, packed=self.tied_head_packed)
        else:
            logits = self.lm_head(hidden)
        if self.parallel is not None:
            logits = self.parallel.gather_vocab(logits)
            if logits is None:
                return None
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, source: str) -> None:
        """Copies Hugging Face-named tensors into the (fused) parameters; every parameter must
        be covered exactly once, or the load fails naming what is missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, shard = name, None
            for fragment, (fused, index) in self._FUSED.items():
                if f".{fragment}." in name:
                    target, shard = name.replace(f".{fragment}.", f".{fused}."), index
                    break
            param = params.get(target)
            if param is None:
                raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint", path=source)
            destination = param.data if shard is None else self._shard(param.data, target, shard)
            if destination.shape != tensor.shape:
                raise ModelLoadError(
                    f"tensor {hf_name!r} has shape {list(tensor.shape)}, expected {list(destination.shape)}",
                    path=source,
                )
            if self._rank_zero_only(target):
                destination.zero_()  # a row-parallel bias: added once, by rank 0's partial sum
            elif shard is None and tensor.dtype == param.dtype and tensor.device == param.device:
                param.data = tensor.contiguous()  # adopt it: no second copy held while loading
            else:
                destination.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        expected = {
            name if count == 1 else f"{name}#{index}"
            for name in params
            for count in (self._shard_count(name),)
            for index in range(count)
        }
        if missing := sorted(expected - loaded):
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}", path=source)

    @staticmethod
    def _shard_count(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1

    def _rank_zero_only(self, name: str) -> bool:
        return (
            self.parallel is not None and self.parallel.rank != 0
            and name.endswith((".o_proj.bias", ".down_proj.bias"))
        )

    def _shard(self, data: torch.Tensor, name: str, index: int) -> torch.Tensor:
        if ".qkv_proj." in name:
            sizes = self.layers[0].self_attn.split_sizes
        else:
            sizes = (self.layers[0].mlp.size,) * 2
        start = sum(sizes[:index])
        return data.narrow(0, start, sizes[index])


# (dim, start, stop) of a checkpoint tensor that one rank reads; None: the whole tensor.
CheckpointSlice = tuple[int, int, int] | None


def checkpoint_slices(config: ModelConfig, partition: Partition) -> Callable[[str], CheckpointSlice]:
    """For a Hugging Face tensor name, the slice that ``partition``'s rank loads."""
    dim = config.head_dim
    q = (partition.q_heads[0] * dim, partition.q_heads[1] * dim)
    kv = (partition.kv_heads[0] * dim, partition.kv_heads[1] * dim)
    rules = (
        # (name fragment, dim, range); biases of column-parallel layers split like the rows
        (".q_proj.", 0, q),
        (".k_proj.", 0, kv),
        (".v_proj.", 0, kv),
        (".o_proj.weight", 1, q),
        (".gate_proj.", 0, partition.intermediate),
        (".up_proj.", 0, partition.intermediate),
        (".down_proj.weight", 1, partition.intermediate),
    )

    def select(hf_name: str) -> CheckpointSlice:
        name = f".{hf_name.removeprefix('model.')}"
        if name in (".embed_tokens.weight", ".lm_head.weight"):
            return (0, *partition.vocab)
        for fragment, axis, (start, stop) in rules:
            if fragment in name:
                return (axis, start, stop)
        return None

    return select
