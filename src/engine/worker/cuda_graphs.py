"""Decode steps replayed from CUDA graphs: the whole forward (and the LM head) of a pure-decode
step captured once per batch-size bucket at start-up, so that a step costs one graph launch
instead of a few hundred kernel launches behind Python.

A bucket of B sequences reads its inputs from static buffers shared by every bucket: token
ids, positions, KV slots, sequence lengths and block tables of the first B rows. A step of
n <= B decodes copies its inputs into the first n rows, pads the other B - n as one-token
sequences that write and read only a scratch KV block no sequence owns, replays the graph and
takes the first n rows of the logits. The attention kernels were captured with the longest
context the engine allows (``max_model_len``), so their launch grids fit every step; each
sequence's own length comes from the ``seq_lens`` buffer. Steps with a prefill, or more
decodes than the largest bucket, run eagerly; sampling (logprobs, grammar masks, penalties)
always runs eagerly on the graph's logits.

The capture itself is a strategy (``GraphCapture``): ``CudaGraphCapture`` on a GPU; tests on a
CPU use ``EagerReplay``, which re-runs the captured function against the same static buffers,
so the padding and buffer logic is checked on every machine.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from triode.kernels import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's shape: small batches one by one, then steps of 8, then powers of two.
_SMALL_BUCKETS = (1, 2, 4)
# The largest batch captured, as vLLM's default: past it a step's arithmetic, not its launches,
# sets the pace, and every bucket's static buffers and graph memory grow with it (a
# max_num_seqs of 10**9 would ask a capture of that many rows).
MAX_CAPTURED_BATCH = 512


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes captured: 1, 2, 4, 8, 16, 24, ... up to 256, then 512, each at most
    ``max_num_seqs`` (which is always one, when it is at most ``MAX_CAPTURED_BATCH``); larger
    decode steps run eagerly."""
    largest = min(max_num_seqs, MAX_CAPTURED_BATCH)
    sizes = {b for b in _SMALL_BUCKETS if b <= largest}
    sizes.update(range(8, min(largest, 256) + 1, 8))
    sizes.add(largest)
    return tuple(sorted(sizes))


class ReplayableStep(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[ReplayableStep, torch.Tensor]:
        """Captures ``run`` (which reads the static buffers); returns the replayable step and
        the tensor each replay writes the result into."""


class CudaGraphCapture:
    """torch.cuda.CUDAGraph capture, every bucket in one memory pool (captured largest first,
    so the smaller ones reuse its memory), after a warm-up run that compiles the kernels."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[ReplayableStep, torch.Tensor]:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()  # compiles and autotunes outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        self.pool = graph.pool()
        return graph, output


class EagerReplay:
    """The capture strategy of tests without a GPU: a "replay" runs the function again, on
    whatever the static buffers hold then, into the same output tensor."""

    def __call__(self, run: Callable[[], torch.Tensor]) -> tuple[ReplayableStep, torch.Tensor]:
        output = run()

        class _Replay:
            @staticmethod
            def replay() -> None:
                output.copy_(run())

        return _Replay(), output


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        *,
        buckets: Sequence[int],
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        capture: GraphCapture,
    ) -> None:
        """``forward(token_ids, positions, metadata)`` -> logits of every row; ``scratch_block``:
        a KV block no sequence is given, which the padding rows write and read."""
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        width = -(-max_model_len // block_size)
        rows = self.max_batch
        self._scratch_block = scratch_block
        self._scratch_slot = scratch_block * block_size
        self._token_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self._positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self._slots = torch.full((rows,), self._scratch_slot, dtype=torch.int64, device=device)
        self._seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self._tables = torch.full((rows, width), scratch_block, dtype=torch.int32, device=device)
        self._starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[ReplayableStep, torch.Tensor]] = {}
        started = time.perf_counter()
        memory_before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        for batch in sorted(self.buckets, reverse=True):
            metadata = AttentionMetadata(
                slot_mapping=self._slots[:batch], query_start_loc=self._starts[: batch + 1],
                seq_lens=self._seq_lens[:batch], block_tables=self._tables[:batch], num_decodes=batch,
                max_query_len=1, max_seq_len=max_model_len,
                query_start_loc_host=tuple(range(batch + 1)), seq_lens_host=(max_model_len,) * batch,
            )
            tokens, positions = self._token_ids[:batch], self._positions[:batch]
            self._graphs[batch] = capture(lambda t=tokens, p=positions, m=metadata: forward(t, p, m))
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = (torch.cuda.memory_reserved(device) - memory_before) if device.type == "cuda" else 0

    def bucket_for(self, num_decodes: int) -> int | None:
        """The smallest captured batch that holds ``num_decodes`` sequences, or None."""
        index = bisect.bisect_left(self.buckets, num_decodes)
        return self.buckets[index] if index < len(self.buckets) else None

    def takes(self, metadata: AttentionMetadata) -> bool:
        """Whether a step is one a graph runs: only decodes, as many as a captured batch holds."""
        return metadata.num_decodes == metadata.num_seqs and self.bucket_for(metadata.num_seqs) is not None

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Logits [n, vocab] of a pure-decode step of n <= ``max_batch`` sequences."""
        n = metadata.num_seqs
        batch = self.bucket_for(n)
        if batch is None or metadata.num_decodes != n:
            raise ValueError(f"a captured decode step takes up to {self.max_batch} decodes, got "
                             f"{metadata.num_decodes} decodes of {n} sequences")
        self._token_ids[:n].copy_(token_ids)
        self._positions[:n].copy_(positions)
        self._slots[:n].copy_(metadata.slot_mapping)
        self._seq_lens[:n].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        self._tables[:n, :width].copy_(metadata.block_tables[:n])
        if n < batch:  # rows past n keep what the last larger step left: padding again
            self._token_ids[n:batch].zero_()
            self._positions[n:batch].zero_()
            self._slots[n:batch].fill_(self._scratch_slot)
            self._seq_lens[n:batch].fill_(1)
            self._tables[n:batch, 0].fill_(self._scratch_block)
        graph, logits = self._graphs[batch]
        graph.replay()
        return logits[:n]


def capture_decode_graphs(
    forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
    *,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    scratch_block: int,
    device: torch.device,
    capture: GraphCapture | None = None,
) -> DecodeGraphs | None:
    """The decode graphs of a runner, or None (logged with its cause) if capturing failed:
    the engine then runs every step eagerly."""
    buckets = batch_buckets(max_num_seqs)
    try:
        with torch.inference_mode():  # as every step runs
            graphs = DecodeGraphs(forward, buckets=buckets, max_model_len=max_model_len, block_size=block_size,
                                  scratch_block=scratch_block, device=device,
                                  capture=capture or CudaGraphCapture(device))
    except Exception as error:
        logger.warning("capturing decode graphs failed (%s: %s); every step runs eagerly",
                       type(error).__name__, error)
        return None
    logger.info("captured decode graphs for %d batch sizes (1..%d) in %.1f s, %.0f MiB", len(buckets),
                buckets[-1], graphs.capture_seconds, graphs.capture_bytes / 2**20)
    return graphs
