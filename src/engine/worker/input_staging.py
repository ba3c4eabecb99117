"""A step's index tensors (token ids, positions, slots, lengths, block tables) sent to a GPU in
one host-to-device copy, through buffers kept from step to step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_ALIGNMENT = 8  # bytes: every segment starts where an int64 view may start


class InputStaging:
    """A host buffer (pinned, on a CUDA worker) and a device buffer of the same size, grown as
    steps need and reused: ``upload`` lays a step's host tensors side by side in the host buffer
    and copies them up at once, asynchronously, where one copy per tensor would be a launch
    each and, from pageable memory, a synchronization each.

    The device buffer is rewritten by the next step's copy, which the stream orders after this
    step's kernels. The host buffer is rewritten by the CPU, which may run a step ahead of the
    GPU (a tensor-parallel rank other than 0 never waits for its step's results), so each
    upload first waits for the previous copy to have read it (an event: the copy is the first
    thing a step puts on the stream, so this rarely waits)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._device = torch.empty(0, dtype=torch.uint8, device=device)
        self._copied = None  # a CUDA event recorded after the last copy
        self.copies = 0  # host-to-device copies so far (one per upload)

    def upload(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (host tensors of any dtype and shape) on the device, as views into the
        device buffer, valid until the next ``upload``."""
        if self._copied is not None:
            self._copied.synchronize()
        offsets, total = [], 0
        for tensor in tensors:
            offsets.append(total)
            total += -(-tensor.numel() * tensor.element_size() // _ALIGNMENT) * _ALIGNMENT
        if self._host.numel() < total:
            size = max(total, 2 * self._host.numel())
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._device = torch.empty(size, dtype=torch.uint8, device=self.device)
        for tensor, offset in zip(tensors, offsets, strict=True):
            self._segment(self._host, tensor, offset).copy_(tensor)
        self._device[:total].copy_(self._host[:total], non_blocking=True)
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.copies += 1
        return [self._segment(self._device, tensor, offset) for tensor, offset in zip(tensors, offsets, strict=True)]

    @staticmethod
    def _segment(buffer: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
        size = like.numel() * like.element_size()
        return buffer[offset:offset + size].view(like.dtype).view(like.shape)
