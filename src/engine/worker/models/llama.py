"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, and the mixtures of experts Mixtral and
Qwen3-MoE) over the paged KV cache; models.gemma builds Gemma 2 and 3 on these modules.

One implementation: they differ in attention biases (Qwen2), per-head q/k RMSNorm (Qwen3),
head_dim, rope scaling, which layers have a sliding window, and MoE layers in place of the MLP
(models.moe), all read from ModelConfig. q/k/v and gate/up are fused into one matmul each;
their weights are concatenated at load time (a checkpoint that fuses them, Phi-3's, is cut
into the parts first: models.fused_checkpoint).

Tensor parallelism (``parallel`` given): the same modules hold one rank's shard, as
``engine.worker.distributed.Partition`` assigns it: q/k/v and gate/up are column-parallel
(their rows split), o_proj and down_proj row-parallel (columns split, then an all-reduce;
their biases live on rank 0 only), the embedding and LM head vocabulary-parallel (masked
lookup + all-reduce; partial logits gathered on rank 0). ``checkpoint_slices`` tells the
loader which slice of each checkpoint tensor a rank reads. Without ``parallel`` nothing of
this runs: no collective, no mask, the single-rank forward is unchanged.

Quantized weights (a GGUF checkpoint on a CPU with the kernels): :meth:`keep_quantized`, called
on the model before its parameters are allocated, turns the linear layers and the embedding
whose checkpoint tensors are quantized into holders of :class:`kernels.QuantizedWeight`
parts, so the float copy is never allocated; a fused layer keeps one part per checkpoint
tensor (q, k and v may have different block types), each writing its columns of the output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import torch
from torch import nn

import kernels
from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.worker.distributed import Partition, TensorParallelGroup
from engine.worker.host_memory import weight_tensor
from engine.worker.models.cpu_decode import build_decode_stack, decode_stack_supported
from engine.worker.models.moe import EXPERT_TENSOR, SparseMoE
from engine.worker.models.rope import cos_sin_cache

KVCache = tuple[torch.Tensor, torch.Tensor]


class QuantizedParts:
    """A module whose weight may be replaced by quantized parts (:meth:`quantize_parts`),
    stacked along the output rows, before its parameters are allocated."""

    parts: list[kernels.QuantizedWeight | None] | None = None

    def quantize_parts(self, count: int) -> None:
        del self.weight  # a registered parameter: the float copy is never allocated
        self.weight = None
        self.parts = [None] * count


class Linear(QuantizedParts, nn.Linear):
    """nn.Linear through ``kernels.linear``; on a CPU, :meth:`pack` (once the weight is loaded)
    gives it oneDNN's packed copy of the weight. With quantized parts, each part computes its
    columns of the output with the quantized kernels; :meth:`pack` joins parts of one block
    type into one weight (rows are independent blocks), so a fused layer is one kernel call."""

    packed_weight: torch.Tensor | None = None

    def pack(self) -> None:
        if self.parts is None:
            self.packed_weight = kernels.pack_linear_weight(self.weight.detach())
        elif len(self.parts) > 1 and len({part.kind for part in self.parts}) == 1:
            first = self.parts[0].data
            rows = weight_tensor([sum(part.data.shape[0] for part in self.parts), first.shape[1]], first.dtype)
            torch.cat([part.data for part in self.parts], out=rows)
            self.parts = [kernels.QuantizedWeight(self.parts[0].kind, rows, self.in_features)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            return kernels.linear(x, self.weight, self.bias, self.packed_weight)
        if len(self.parts) == 1:
            return self.parts[0].linear(x, self.bias)
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        start = 0
        for part in self.parts:
            stop = start + part.out_features
            part.linear(x, None if self.bias is None else self.bias[start:stop], out=out[:, start:stop])
            start = stop
        return out


class Embedding(QuantizedParts, nn.Embedding):
    """nn.Embedding; with a quantized table, the rows looked up are dequantized."""

    def reset_parameters(self) -> None:
        # The table always comes from the checkpoint; and normal_ on the meta device goes
        # through torch's refs, which import torch._dynamo (about 150 MB in every worker).
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return self.parts[0].dequantize(ids)
        return super().forward(ids)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.rms_norm(x, self.weight, self.eps, residual)


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
    decoder_layer: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(
        self, config: ModelConfig, *, max_positions: int, parallel: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        vocab = parallel.partition.vocab_size if parallel else config.vocab_size
        self.embed_tokens = Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, layer, parallel) for layer in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings
            else Linear(config.hidden_size, vocab, bias=False)
        )
        self.max_positions = max_positions
        self.tied_head_packed: torch.Tensor | None = None
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
        if self.lm_head is None and self.embed_tokens.parts is None:
            self.tied_head_packed = kernels.pack_linear_weight(self.embed_tokens.weight.detach())

    def keep_quantized(self, kinds: Mapping[str, str]) -> None:
        """Before the parameters are allocated: the layers whose checkpoint tensors (Hugging
        Face names -> block type, ``kinds``) are all quantized will hold those tensors as
        they are."""
        sources: dict[str, list[str]] = {}
        experts: dict[str, int] = {}  # MoE layer -> its quantized expert tensors
        for hf_name in kinds:
            if expert := EXPERT_TENSOR.match(hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")):
                experts[f"{expert.group(1)}.mlp"] = experts.get(f"{expert.group(1)}.mlp", 0) + 1
                continue
            target, _ = self._target(hf_name)
            sources.setdefault(target, []).append(hf_name)
        for name, count in experts.items():
            if isinstance(moe := self._submodule(name), SparseMoE) and count == 3 * self.config.num_experts:
                moe.keep_quantized()
        for target, names in sources.items():
            module_name, _, leaf = target.rpartition(".")
            module = self._submodule(module_name)
            count = self._shard_count(target)
            if leaf == "weight" and isinstance(module, QuantizedParts) and len(names) == count:
                module.quantize_parts(count)

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
            hidden, residual = stack.run(hidden, positions, metadata)
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

    def _submodule(self, name: str) -> nn.Module | None:
        try:
            return self.get_submodule(name)
        except AttributeError:
            return None

    def _target(self, hf_name: str) -> tuple[str, int | None]:
        """Our parameter for a Hugging Face tensor name, and its shard index if fused."""
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        for fragment, (fused, index) in self._FUSED.items():
            if f".{fragment}." in name:
                return name.replace(f".{fragment}.", f".{fused}."), index
        return name, None

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | kernels.QuantizedWeight]], *, source: str
    ) -> None:
        """Copies Hugging Face-named tensors into the (fused) parameters, or the quantized
        parts :meth:`keep_quantized` made room for (a quantized tensor for any other parameter
        is dequantized); every parameter must be covered exactly once, or the load fails
        naming what is missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if expert := EXPERT_TENSOR.match(name.replace(".block_sparse_moe.", ".mlp.")):
                loaded.add(self._load_expert(expert, hf_name, tensor, source))
                continue
            target, shard = self._target(hf_name)
            module_name, _, leaf = target.rpartition(".")
            module = self._submodule(module_name)
            key = target if shard is None else f"{target}#{shard}"
            if isinstance(module, QuantizedParts) and module.parts is not None and leaf == "weight":
                expected = self._part_shape(module, target, shard)
                if not isinstance(tensor, kernels.QuantizedWeight) or tensor.shape != expected:
                    got = list(tensor.shape) if isinstance(tensor, kernels.QuantizedWeight) else "not quantized"
                    raise ModelLoadError(f"tensor {hf_name!r} is {got}, expected quantized {list(expected)}",
                                         path=source)
                module.parts[shard or 0] = tensor
                loaded.add(key)
                continue
            if isinstance(tensor, kernels.QuantizedWeight):
                tensor = tensor.dequantize()
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
            loaded.add(key)
        names = list(params) + [f"{name}.weight" for name, module in self.named_modules()
                                if isinstance(module, QuantizedParts) and module.parts is not None]
        expected = {
            name if count == 1 else f"{name}#{index}"
            for name in names
            for count in (self._shard_count(name),)
            for index in range(count)
        }
        for name, module in self.named_modules():
            if isinstance(module, SparseMoE):
                expected -= {f"{name}.w_gate_up", f"{name}.w_down"}
                expected |= {f"{name}.experts.{e}.{part}" for e in range(self.config.num_experts)
                             for part in ("gate", "up", "down")}
        if missing := sorted(expected - loaded):
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}", path=source)

    def _load_expert(self, match, hf_name: str, tensor, source: str) -> str:
        """Copies one expert's gate, up or down weight into its MoE layer's stacked tensors;
        returns the key load_weights counts it under."""
        layer, expert, part = match.group(1), int(match.group(2)), match.group(3)
        moe = self._submodule(f"{layer}.mlp")
        if not isinstance(moe, SparseMoE) or expert >= self.config.num_experts:
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint", path=source)
        kind = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}.get(part, "down")
        if moe.quantized is not None:
            if not isinstance(tensor, kernels.QuantizedWeight) or tensor.shape != moe.expected_shape(part):
                got = list(tensor.shape) if isinstance(tensor, kernels.QuantizedWeight) else "not quantized"
                raise ModelLoadError(f"tensor {hf_name!r} is {got}, expected quantized "
                                     f"{list(moe.expected_shape(part))}", path=source)
            moe.keep(part, expert, tensor)
            return f"{layer}.mlp.experts.{expert}.{kind}"
        if isinstance(tensor, kernels.QuantizedWeight):
            tensor = tensor.dequantize()
        destination = moe.expert_destination(part, expert)
        if destination.shape != tensor.shape:
            raise ModelLoadError(f"tensor {hf_name!r} has shape {list(tensor.shape)}, expected "
                                 f"{list(destination.shape)}", path=source)
        destination.copy_(tensor)
        return f"{layer}.mlp.experts.{expert}.{kind}"

    def _part_shape(self, module: nn.Module, target: str, shard: int | None) -> tuple[int, int]:
        if isinstance(module, Embedding):
            return (module.num_embeddings, module.embedding_dim)
        if shard is None:
            return (module.out_features, module.in_features)
        return (self._split_sizes(target)[shard], module.in_features)

    @staticmethod
    def _shard_count(name: str) -> int:
        return 3 if ".qkv_proj." in name else 2 if ".gate_up_proj." in name else 1

    def _rank_zero_only(self, name: str) -> bool:
        return (
            self.parallel is not None and self.parallel.rank != 0
            and name.endswith((".o_proj.bias", ".down_proj.bias"))
        )

    def _split_sizes(self, name: str) -> tuple[int, ...]:
        if ".qkv_proj." in name:
            return self.layers[0].self_attn.split_sizes
        # this layer's MLP: Qwen3-MoE's dense layers are wider than its experts
        return (self._submodule(name.rpartition(".gate_up_proj.")[0]).size,) * 2

    def _shard(self, data: torch.Tensor, name: str, index: int) -> torch.Tensor:
        sizes = self._split_sizes(name)
        return data.narrow(0, sum(sizes[:index]), sizes[index])


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
        name = f".{hf_name.removeprefix(config.weights_prefix).removeprefix('model.')}"
        if name in (".embed_tokens.weight", ".lm_head.weight"):
            return (0, *partition.vocab)
        if ".experts." in name:  # every expert's intermediate features, as a dense MLP's
            return (1 if name.endswith((".w2.weight", ".down_proj.weight")) else 0, *partition.moe_intermediate)
        for fragment, axis, (start, stop) in rules:
            if fragment in name:
                return (axis, start, stop)
        return None

    return select
