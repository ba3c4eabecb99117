"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, and the mixtures of experts Mixtral and
Qwen3-MoE) over the paged KV cache; models.gemma builds Gemma 2 and 3 on these modules.

One implementation: they differ in attention biases (Qwen2), per-head q/k RMSNorm (Qwen3),
head_dim, rope scaling, which layers have a sliding window, and MoE layers in place of the MLP
(models.moe), all read from ModelConfig. q/k/v and gate/up are fused into one matmul each;
their weights are concatenated at load time (a checkpoint that fuses them, Phi-3's, is cut
into the parts first: models.fused_checkpoint).

Tensor parallelism (``parallel`` given): the same modules hold one rank's shard, as
``triode.engine.worker.distributed.Partition`` assigns it: q/k/v and gate/up are column-parallel
(their rows split), o_proj and down_proj row-parallel (columns split, then an all-reduce;
their biases live on rank 0 only), the embedding and LM head vocabulary-parallel (masked
lookup + all-reduce; partial logits gathered on rank 0). ``checkpoint_slices`` tells the
loader which slice of each checkpoint tensor a rank reads. Without ``parallel`` nothing of
this runs: no collective, no mask, the single-rank forward is unchanged.

The layers are in models.layers; loading a checkpoint (names, fused and quantized tensors,
experts, tensor-parallel slices) in models.weight_loading.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from triode import kernels
from triode.engine.model.config import ModelConfig
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.lora import LoRAStep
from triode.engine.worker.models.cpu_decode import build_decode_stack, decode_stack_supported
from triode.engine.worker.models.layers import Embedding, Linear, RMSNorm, interleaved_parts
from triode.engine.worker.models.moe import SparseMoE
from triode.engine.worker.models.rope import cos_sin_cache
from triode.engine.worker.models.weight_loading import CheckpointLoading, checkpoint_slices
from triode.kernels.packed_linear import PACK_MIN_WEIGHTS

__all__ = [
    "MLP",
    "Attention",
    "DecoderLayer",
    "Embedding",
    "Linear",
    "LlamaForCausalLM",
    "RMSNorm",
    "checkpoint_slices",
]

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        partition = parallel.partition if parallel is not None else None
        self.num_heads = partition.num_q_heads if partition else config.num_heads
        self.num_kv_heads = partition.num_kv_heads if partition else config.num_kv_heads
        self.parallel = parallel
        self.head_dim = config.head_dim
        self.rotary_dim = config.rope_dim
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcapping
        # Gemma 3's sliding layers rotate with their own base (the model's local_rope_cache)
        self.local_rope = config.local_rope_theta is not None and self.window is not None
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
        if self.rotary_dim < self.head_dim:  # the leading dimensions rotate, the rest pass
            kernels.rotary_embedding(positions, q[..., :self.rotary_dim], k[..., :self.rotary_dim], rope_cache)
        else:
            kernels.rotary_embedding(positions, q, k, rope_cache)
        k_cache, v_cache = kv_cache
        kernels.write_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = kernels.paged_attention(q, k, v, k_cache, v_cache, metadata, self.scale, window=self.window,
                                      softcap=self.softcap)
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
        self.act_and_mul = kernels.silu_and_mul if config.hidden_act == "silu" else kernels.gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        if self.parallel is not None:
            self.parallel.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parallel: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, parallel)
        self.mlp = (SparseMoE(config, Linear(config.hidden_size, config.num_experts, bias=False), parallel)
                    if config.layer_is_moe(layer) else MLP(config, parallel))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def input_norm(self, hidden, residual):
        """(normed input, residual stream): the first layer's stream is its input."""
        if residual is None:
            return self.input_layernorm(hidden)[0], hidden
        return self.input_layernorm(hidden, residual)

    def forward(self, positions, hidden, residual, kv_cache, metadata, rope_cache):
        hidden, residual = self.input_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, rope_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CheckpointLoading, nn.Module):
    """Also serves MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(
        self, config: ModelConfig, *, max_positions: int, parallel: TensorParallelGroup | None = None,
        head: bool = True,
    ) -> None:
        """``head``: False for a pooling model, which reads its hidden states (no LM head)."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        vocab = parallel.partition.vocab_size if parallel else config.vocab_size
        self.embed_tokens = Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, layer, parallel) for layer in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = head and not config.base_model
        self.lm_head = (
            None if config.tie_word_embeddings or not self.head
            else Linear(config.hidden_size, vocab, bias=False)
        )
        self.max_positions = max_positions
        self.tied_head_packed: torch.Tensor | None = None
        # With LoRA enabled, the step's rows' adapter slots (triode.engine.worker.lora), which
        # the C decode stack reads; the modules read them from their own stacks.
        self.lora_step: LoRAStep | None = None
        # Pure-decode steps of a quantized CPU model run every layer in one C call
        # (models.cpu_decode); False runs the modules (the tests compare the two).
        self.decode_stack_enabled = True
        self._decode_stack: tuple[object, kernels.DecodeStack | None] | None = None  # (caches, stack)
        self._decode_stack_supported: bool | None = None
        self.register_buffer("rope_cache", torch.empty(0), persistent=False)
        self.register_buffer("local_rope_cache", torch.empty(0), persistent=False)

    def pack_linear_weights(self) -> None:
        """Packs every linear weight for ``kernels.linear`` (on a CPU; elsewhere nothing is
        packed). Call after the weights are loaded: a later change to them is not seen."""
        for module in self.modules():
            if isinstance(module, Linear | SparseMoE):
                module.pack()
        if self.head and self.lm_head is None and self.embed_tokens.parts is None:
            self.tied_head_packed = kernels.pack_linear_weight(self.embed_tokens.weight.detach(),
                                                                min_weights=PACK_MIN_WEIGHTS)
        elif self.head and self.lm_head is None:
            # The table is the LM head too: interleaved for its matmul; lookups read any layout.
            self.embed_tokens.parts = interleaved_parts(self.embed_tokens.parts)

    def quantized_matrices(self) -> list[kernels.QuantizedWeight]:
        """Every quantized weight this model multiplies by: its linears' parts, its experts'
        and the table's where it is the LM head (a lookup reads any layout)."""
        matrices = []
        for module in self.modules():
            if isinstance(module, Linear) and module.parts is not None:
                matrices += module.parts
            elif isinstance(module, SparseMoE) and module.quantized is not None:
                matrices += [weight for expert in module.quantized for weight in expert]
        if self.head and self.lm_head is None and self.embed_tokens.parts is not None:
            matrices += self.embed_tokens.parts
        return matrices

    def init_rope(self) -> None:
        config = self.config
        self.rope_cache = cos_sin_cache(
            config.rope_dim, config.rope_theta, config.rope_scaling, self.max_positions,
            self.norm.weight.device,
        )
        if config.local_rope_theta is not None:
            self.local_rope_cache = cos_sin_cache(config.rope_dim, config.local_rope_theta, None,
                                                  self.max_positions, self.norm.weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: kernels.AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of a flattened step batch."""
        hidden = self.embed(input_ids)
        stack = self._decode_stack_for(kv_caches)
        if stack is not None and stack.takes(hidden.shape[0], metadata, kv_caches):
            lora_slots = self.lora_step.row_slots if self.lora_step is not None else None
            hidden, residual = stack.run(hidden, positions, metadata, lora_slots)
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                rope = self.local_rope_cache if layer.self_attn.local_rope else self.rope_cache
                hidden, residual = layer(positions, hidden, residual, kv_cache, metadata, rope)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) if self.parallel is None else self._embed_shard(input_ids)

    def _decode_stack_for(self, kv_caches: list[KVCache]) -> kernels.DecodeStack | None:
        if not self.decode_stack_enabled or kernels.get_backend() != "auto":
            return None
        if self._decode_stack_supported is None:
            self._decode_stack_supported = decode_stack_supported(self)
        if not self._decode_stack_supported:
            return None
        if self._decode_stack is None or self._decode_stack[0] is not kv_caches:
            self._decode_stack = (kv_caches, build_decode_stack(self, kv_caches))
        return self._decode_stack[1]

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Vocabulary-parallel: rows of ids outside this rank's range are zero, the sum over the
        # ranks is the full lookup.
        start, stop = self.parallel.partition.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= stop - start)
        hidden = self.embed_tokens(local.masked_fill(outside, 0))
        hidden.masked_fill_(outside[:, None], 0.0)
        return self.parallel.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab]. Under tensor parallelism every rank must call it (it
        gathers the vocabulary shards); rank 0 gets the logits, the other ranks None."""
        if self.lm_head is None and self.embed_tokens.parts is not None:
            logits = self.embed_tokens.parts[0].linear(hidden)
        elif self.lm_head is None:
            logits = kernels.linear(hidden, self.embed_tokens.weight, packed=self.tied_head_packed)
        else:
            logits = self.lm_head(hidden)
        if self.parallel is not None:
            logits = self.parallel.gather_vocab(logits)
            if logits is None:
                return None
        return logits.float()
