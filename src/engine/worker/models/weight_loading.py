"""Loading a checkpoint into the Llama-family modules: Hugging Face tensor names onto our fused
parameters (q/k/v and gate/up concatenated), each MoE expert's tensors into its layer's stacked
weights, quantized tensors kept as they are where the layers allow it, and every parameter
covered exactly once, or a ModelLoadError naming the tensor and the file. Under tensor
parallelism ``checkpoint_slices`` names the slice of each tensor a rank reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import torch
from torch import nn

from triode import kernels
from triode.engine.errors import ModelLoadError
from triode.engine.model.config import ModelConfig
from triode.engine.worker.distributed import Partition
from triode.engine.worker.models.layers import Embedding, QuantizedParts
from triode.engine.worker.models.moe import EXPERT_PARTS, SparseMoE, expert_tensor

__all__ = ["CheckpointLoading", "CheckpointSlice", "checkpoint_slices"]


class CheckpointLoading:
    """The loader of LlamaForCausalLM (a mixin: it reads the model's config, layers and
    parallel group)."""

    config: ModelConfig
    # Hugging Face parameter name fragment -> (our fused parameter, shard index)
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def keep_quantized(self, kinds: Mapping[str, str]) -> None:
        """Before the parameters are allocated: the layers whose checkpoint tensors (Hugging
        Face names -> block type, ``kinds``) are all quantized will hold those tensors as
        they are."""
        sources: dict[str, list[str]] = {}
        experts: dict[str, int] = {}  # MoE layer -> its quantized expert tensors
        for hf_name in kinds:
            if expert := expert_tensor(hf_name.removeprefix("model.")):
                experts[expert[0]] = experts.get(expert[0], 0) + 1
                continue
            target, _ = self._target(hf_name)
            sources.setdefault(target, []).append(hf_name)
        for name, count in experts.items():
            if isinstance(moe := self._submodule(name), SparseMoE) and count == len(EXPERT_PARTS) * self.config.num_experts:
                moe.keep_quantized()
        for target, names in sources.items():
            module_name, _, leaf = target.rpartition(".")
            module = self._submodule(module_name)
            count = self._shard_count(target)
            if leaf == "weight" and isinstance(module, QuantizedParts) and len(names) == count:
                module.quantize_parts(count)

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
            if expert := expert_tensor(name):
                loaded.add(self._load_expert(*expert, hf_name, tensor, source))
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
            _check_floating(hf_name, tensor, source)
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
                             for part in EXPERT_PARTS}
        if missing := sorted(expected - loaded):
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}", path=source)

    def _load_expert(self, layer: str, expert: int, part: int, hf_name: str, tensor, source: str) -> str:
        """Copies one expert's gate, up or down weight into its MoE layer (``layer``), stacked or
        kept quantized; returns the key load_weights counts it under."""
        moe = self._submodule(layer)
        if not isinstance(moe, SparseMoE) or expert >= self.config.num_experts:
            raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint", path=source)
        if moe.quantized is not None:
            if not isinstance(tensor, kernels.QuantizedWeight) or tensor.shape != moe.expected_shape(part):
                got = list(tensor.shape) if isinstance(tensor, kernels.QuantizedWeight) else "not quantized"
                raise ModelLoadError(f"tensor {hf_name!r} is {got}, expected quantized "
                                     f"{list(moe.expected_shape(part))}", path=source)
            moe.keep(part, expert, tensor)
        else:
            if isinstance(tensor, kernels.QuantizedWeight):
                tensor = tensor.dequantize()
            destination = moe.expert_destination(part, expert)
            _check_floating(hf_name, tensor, source)
            if destination.shape != tensor.shape:
                raise ModelLoadError(f"tensor {hf_name!r} has shape {list(tensor.shape)}, expected "
                                     f"{list(destination.shape)}", path=source)
            destination.copy_(tensor)
        return f"{layer}.experts.{expert}.{EXPERT_PARTS[part]}"

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


def _check_floating(hf_name: str, tensor: torch.Tensor, source: str) -> None:
    """Weights are floats: integer or boolean tensors were cast and ran as garbage."""
    if not tensor.is_floating_point():
        raise ModelLoadError(f"tensor {hf_name!r} is {str(tensor.dtype).removeprefix('torch.')}, not a "
                             f"floating-point type (nor a quantized one triode reads)", path=source)
