"""Argument checks shared by the launchers: a wrong tensor fails with a ValueError that names
it, instead of a kernel that reads out of bounds."""

from __future__ import annotations

import torch


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int | None = None,
    shape: tuple[int, ...] | torch.Size | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = True,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if ndim is not None and tensor.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(tensor.shape)}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if tensor.dtype not in allowed:
            raise ValueError(f"{name}: expected dtype {' or '.join(map(str, allowed))}, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (strides {tensor.stride()})")
    if last_dim_contiguous and tensor.ndim and tensor.stride(-1) != 1 and tensor.numel() > 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (strides {tensor.stride()})")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_tensor("k_cache", k_cache, ndim=4, contiguous=True)
    check_tensor("v_cache", v_cache, shape=k_cache.shape, dtype=k_cache.dtype,
                 device=k_cache.device, contiguous=True)


def check_launch_device(name: str, tensor: torch.Tensor) -> None:
    """Triton launches on CUDA tensors; on CPU tensors only under ``TRITON_INTERPRET=1``."""
    from triode.kernels._jit import interpreting

    kind = tensor.device.type
    if kind == "cuda" or (kind == "cpu" and interpreting()):
        return
    hint = " (set TRITON_INTERPRET=1 to run the kernels on CPU)" if kind == "cpu" else ""
    raise ValueError(f"{name}: Triton kernels need CUDA tensors, got device {tensor.device}{hint}")


def check_score_rules(window: object, softcap: object) -> None:
    """A sliding window is a positive int (the keys a query sees, itself included) or None; a
    soft cap a positive float or None."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    if softcap is not None and (not isinstance(softcap, int | float) or not softcap > 0):
        raise ValueError(f"softcap: expected a positive number or None, got {softcap!r}")
