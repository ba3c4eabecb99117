"""Checkpoints that store q/k/v or gate/up as one tensor (Phi-3's ``qkv_proj`` and
``gate_up_proj``), read as the separate tensors the loader takes from every other checkpoint.

Each fused tensor is cut along its rows into its parts (quantized ones by whole rows), and a
tensor-parallel rank then keeps its slice of each part: a rank's q, k and v rows are not one
range of the fused rows, so the reader loads a fused tensor whole and the cut happens here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from triode import kernels
from triode.engine.errors import ModelLoadError
from triode.engine.model.config import ModelConfig
from triode.engine.worker.models.weight_loading import CheckpointSlice

Tensor = torch.Tensor | kernels.QuantizedWeight
SliceOf = Callable[[str], CheckpointSlice]  # the slice of each part a rank keeps (checkpoint_slices)

__all__ = ["unfuse", "unfused_names"]


def _parts(config: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Fused name fragment -> (part fragment, rows) in the fused tensor's row order."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        ".qkv_proj.": ((".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)),
        ".gate_up_proj.": ((".gate_proj.", config.intermediate_size), (".up_proj.", config.intermediate_size)),
    }


def _rows(tensor: Tensor, start: int, stop: int) -> Tensor:
    return tensor.rows(start, stop) if isinstance(tensor, kernels.QuantizedWeight) else tensor[start:stop]


def _slice(tensor: Tensor, dim: int, start: int, stop: int) -> Tensor:
    if dim == 0:
        return _rows(tensor, start, stop)
    return tensor.columns(start, stop) if isinstance(tensor, kernels.QuantizedWeight) else tensor[:, start:stop]


def unfuse(weights: Iterable[tuple[str, Tensor]], config: ModelConfig, *,
           slice_of: SliceOf | None = None, source: str) -> Iterator[tuple[str, Tensor]]:
    """``weights`` with every fused tensor replaced by its parts (each cut to ``slice_of``'s
    slice for a tensor-parallel rank); other tensors pass through as they are."""
    layouts = _parts(config)
    for name, tensor in weights:
        fused = next((fragment for fragment in layouts if fragment in f".{name}"), None)
        if fused is None:
            yield name, tensor
            continue
        layout = layouts[fused]
        total = sum(rows for _, rows in layout)
        if tensor.shape[0] != total:
            raise ModelLoadError(f"tensor {name!r} has {tensor.shape[0]} rows, expected {total} "
                                 f"({' + '.join(str(rows) for _, rows in layout)})", path=source)
        start = 0
        for fragment, rows in layout:
            part_name, part = f".{name}".replace(fused, fragment)[1:], _rows(tensor, start, start + rows)
            start += rows
            cut = slice_of(part_name) if slice_of is not None else None
            yield part_name, part if cut is None else _slice(part, *cut)


def unfused_names(kinds: Mapping[str, str], config: ModelConfig) -> dict[str, str]:
    """A checkpoint's quantized tensor names (name -> block type) as :func:`unfuse` names them."""
    layouts = _parts(config)
    names: dict[str, str] = {}
    for name, kind in kinds.items():
        fused = next((fragment for fragment in layouts if fragment in f".{name}"), None)
        parts = [fragment for fragment, _ in layouts[fused]] if fused else []
        names.update({f".{name}".replace(fused, part)[1:]: kind for part in parts} if fused else {name: kind})
    return names
