"""Gemma 2 and Gemma 3 (text), on the Llama family's modules.

What differs from Llama, all read from ModelConfig: norms scale by (1 + weight) (folded into
the weights once they are loaded, so the RMSNorm kernels run unchanged); four norms a layer,
the attention and MLP outputs each normed before their residual add; embeddings scaled by
sqrt(hidden), rounded to the model's dtype as transformers rounds it; a GELU (tanh) MLP; the
attention scale from query_pre_attn_scalar; sliding-window layers interleaved with global ones
(Gemma 3's with their own rope base); Gemma 2's tanh soft cap on attention scores and on the
final logits. The embedding is tied to the LM head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from triode.engine.model.config import ModelConfig
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__(config, layer, parallel)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        # (hidden, residual) in and out as in Llama's layer: their sum is the stream.
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        hidden, _ = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM."""

    decoder_layer = GemmaDecoderLayer

    def load_weights(self, weights: Iterable, *, source: str) -> None:
        super().load_weights(weights, source=source)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.data += 1.0  # transformers computes x_normed * (1 + weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return hidden * torch.tensor(self.config.embedding_multiplier, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
