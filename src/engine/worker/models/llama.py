"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

One implementation: the four differ only in attention biases (Qwen2), per-head q/k RMSNorm
(Qwen3), head_dim and rope scaling, all read from ModelConfig. q/k/v and gate/up are fused
into one matmul each; their weights are concatenated at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

import kernels
from engine.errors import ModelLoadError
from engine.worker.models.config import ModelConfig
from engine.worker.models.rope import cos_sin_cache

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
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
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
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

    def __init__(self, config: ModelConfig, *, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.max_positions = max_positions
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)

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
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, self.rope_cache)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

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

    def _shard(self, data: torch.Tensor, name: str, index: int) -> torch.Tensor:
        if ".qkv_proj." in name:
            sizes = self.layers[0].self_attn.split_sizes
        else:
            sizes = (self.config.intermediate_size,) * 2
        start = sum(sizes[:index])
        return data.narrow(0, start, sizes[index])
