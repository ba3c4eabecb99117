"""LoRA adapters in a worker: their weights in stacked slots on the model's linear layers, an
LRU of resident adapters (``max_loras`` slots) over an LRU of adapters read into host memory
(``max_cpu_loras``), and each step's rows mapped to their adapter's slot.

Each adapted layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) gets a
:class:`LoRAStack`: ``a`` [max_loras, in, P * max_rank] and ``b`` [max_loras, max_rank, out]
(A and B transposed, as ``kernels.add_lora`` takes them), with P the PEFT modules fused in the
layer (q, k, v: 3; gate, up: 2), an adapter's smaller rank zero-padded, its scaling folded
into B, and a module it does not target left zero. The stacks are in the model's dtype; over
a quantized model's float32 activations, in bfloat16 (the weights a step reads are then half
as many bytes: an adapter of rank 16 on every module is a fifth of the default model's). The
layer's forward adds ``kernels.add_lora`` over the step's :class:`~triode.kernels.LoRASegments`
(the runner orders rows so that each adapter's are contiguous).

Under tensor parallelism a rank keeps its shard as vLLM does: column-parallel layers (q, k, v,
gate, up) the rows of B for its output features and all of A; row-parallel ones (o, down) the
columns of A for its input features and all of B, whose partial products the layer's
all-reduce sums with the base output's.

The engine has checked every adapter it sends (``triode.engine.lora.peft_files``), and never
schedules more adapters in one step than there are slots. It asks for an adapter's files to be
read ahead (:meth:`WorkerLoRAs.prefetch`): a thread of the worker reads them while steps run,
and the engine schedules the adapter's sequences once a result says the read is done
(:meth:`WorkerLoRAs.take_news`), so a new adapter never stalls the others' steps. A step that
names an adapter not in host memory (a worker restarted, an adapter dropped by the host LRU)
reads it there and then.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Iterable

import torch
from safetensors import safe_open

from triode import kernels
from triode.engine.lora.peft_files import AdapterFacts, module_shape, read_adapter
from triode.engine.lora.request import LoRARequest
from triode.engine.model.config import ModelConfig
from triode.engine.worker.distributed import Partition

__all__ = ["LoRAStack", "LoRAStep", "WorkerLoRAs"]

logger = logging.getLogger(__name__)

# A model's adapted layer (attribute of a decoder layer's self_attn or mlp) -> the PEFT modules
# whose outputs are its output's slices, in order.
ADAPTED_LAYERS = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("self_attn", "o_proj"): ("o_proj",),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("mlp", "down_proj"): ("down_proj",),
}
_ROW_PARALLEL = ("o_proj", "down_proj")

SlotWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, layer name) -> (a, b)


class LoRAStack:
    """One linear layer's adapters, slot by slot, and the step's segments (shared by every
    stack of the model through ``step``)."""

    def __init__(self, step: LoRAStep, modules: tuple[str, ...], slots: int, rank: int, in_features: int,
                 slices: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.step = step
        self.modules = modules  # the PEFT modules of the output's slices
        self.slices = slices
        self.a = torch.zeros((slots, in_features, len(slices) * rank), dtype=dtype, device=device)
        self.b = torch.zeros((slots, rank, sum(slices)), dtype=dtype, device=device)

    def add_(self, out: torch.Tensor, x: torch.Tensor) -> None:
        segments = self.step.segments
        if segments is not None:
            kernels.add_lora(out, x, self.a, self.b, self.slices, segments)


class LoRAStep:
    """A step's rows' adapters: as segments (the modules' op) and as a slot per row, -1 for
    none (the C decode stack's), or None for a step without adapters."""

    segments: kernels.LoRASegments | None = None
    row_slots: torch.Tensor | None = None


class WorkerLoRAs:
    """The adapters of one rank's model (``model.layers``' attention and MLP layers get a
    ``lora`` stack each)."""

    def __init__(self, model, config: ModelConfig, *, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, partition: Partition | None = None) -> None:
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.partition = partition
        self._step = LoRAStep()
        model.lora_step = self._step
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for layer_index, layer in enumerate(model.layers):
            for (block, name), modules in ADAPTED_LAYERS.items():
                linear = getattr(getattr(layer, block), name, None)
                if linear is None:  # a mixture-of-experts layer has no dense MLP
                    continue
                slices = tuple(self._local_shape(module)[1] for module in modules)
                linear.lora = LoRAStack(self._step, modules, max_loras, max_rank, linear.in_features, slices,
                                        dtype, model.norm.weight.device)
                self.stacks[layer_index, name] = linear.lora
        self.resident: collections.OrderedDict[int, int] = collections.OrderedDict()  # adapter id -> slot, LRU first
        self._host: collections.OrderedDict[int, SlotWeights] = collections.OrderedDict()  # adapter id -> weights
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-reader")
        self._reading: dict[int, concurrent.futures.Future[SlotWeights]] = {}
        self._news: tuple[list[int], list[int], list[tuple[int, str]]] = ([], [], [])  # loaded, evicted, failed

    def _local_shape(self, module: str) -> tuple[int, int]:
        """(in, out) features of ``module`` on this rank."""
        start, stop = self._local_range(module)
        in_features, out_features = module_shape(self.config, module)
        if module in _ROW_PARALLEL:
            return stop - start, out_features
        return in_features, stop - start

    def _local_range(self, module: str) -> tuple[int, int]:
        """The range of ``module``'s sharded dimension (B's rows, or A's columns for a
        row-parallel module) this rank holds."""
        partition, dim = self.partition, self.config.head_dim
        if partition is None:
            in_features, out_features = module_shape(self.config, module)
            return (0, in_features) if module in _ROW_PARALLEL else (0, out_features)
        if module in ("q_proj", "o_proj"):
            return partition.q_heads[0] * dim, partition.q_heads[1] * dim
        if module in ("k_proj", "v_proj"):
            return partition.kv_heads[0] * dim, partition.kv_heads[1] * dim
        return partition.intermediate

    # ---- a step ---------------------------------------------------------------------------

    def begin_step(self, row_adapters: list[LoRARequest | None]) -> None:
        """Makes every adapter of the step resident and maps each row to its slot."""
        wanted = {request.lora_int_id: request for request in row_adapters if request is not None}
        slots = self._make_resident(wanted.values())
        row_slots = [-1 if request is None else slots[request.lora_int_id] for request in row_adapters]
        segments = kernels.LoRASegments.of_rows(row_slots)
        if len(segments):
            self._step.segments = segments
            self._step.row_slots = torch.tensor(row_slots, dtype=torch.int32)

    def end_step(self) -> None:
        self._step.segments = self._step.row_slots = None

    def _make_resident(self, requests: Iterable[LoRARequest]) -> dict[int, int]:
        """Each adapter's slot for this step, placing those not resident (in a free slot, else
        the least recently used one of an adapter the step does not use)."""
        requests = list(requests)
        if len(requests) > self.num_slots:
            raise RuntimeError(f"a step with {len(requests)} adapters, over the {self.num_slots} slots "
                               f"(the scheduler keeps within --max-loras)")
        wanted = {request.lora_int_id for request in requests}
        slots: dict[int, int] = {}
        for request in requests:
            adapter_id = request.lora_int_id
            if adapter_id in self.resident:
                self.resident.move_to_end(adapter_id)
                slots[adapter_id] = self.resident[adapter_id]
                continue
            taken = {*self.resident.values(), *slots.values()}
            free = [slot for slot in range(self.num_slots) if slot not in taken]
            slot = free[0] if free else self.resident.pop(next(i for i in self.resident if i not in wanted))
            slots[adapter_id] = slot
            try:
                weights = self._weights(request)
            except Exception as error:  # its files changed since the engine checked them
                logger.warning("LoRA adapter %r could not be read: %s", request.lora_name, error)
                self._news[2].append((adapter_id, str(error)))
                self._place(slot, {})  # its rows run without an adapter; the engine aborts them
                continue
            self._place(slot, weights)
            self.resident[adapter_id] = slot
        return slots

    @property
    def num_slots(self) -> int:
        return next(iter(self.stacks.values())).a.shape[0]

    def _place(self, slot: int, weights: SlotWeights) -> None:
        for key, stack in self.stacks.items():
            a, b = weights.get(key, (None, None))
            if a is None:
                stack.a[slot].zero_()
                stack.b[slot].zero_()
            else:
                stack.a[slot].copy_(a)
                stack.b[slot].copy_(b)

    # ---- host copies ----------------------------------------------------------------------

    def prefetch(self, requests: Iterable[LoRARequest]) -> None:
        """Starts reading the adapters not in host memory, in the background."""
        for request in requests:
            if request.lora_int_id in self._host:
                self._news[0].append(request.lora_int_id)  # the engine asks again after a restart of its own
            elif request.lora_int_id not in self._reading:
                self._reading[request.lora_int_id] = self._reader.submit(self._read_files, request)

    def wait_for_reads(self, timeout: float) -> None:
        """Returns once a background read is done, or after ``timeout`` seconds."""
        if self._reading:
            concurrent.futures.wait(self._reading.values(), timeout, concurrent.futures.FIRST_COMPLETED)

    def take_news(self) -> dict[str, tuple]:
        """The adapters read into host memory, dropped from it, and whose read failed since the
        last call, as a step result's fields (``loaded_loras``, ``evicted_loras``, ``failed_loras``)."""
        for adapter_id, future in list(self._reading.items()):
            if future.done():
                del self._reading[adapter_id]
                try:
                    self._keep(adapter_id, future.result())
                except Exception as error:  # the files changed since the engine checked them
                    logger.warning("LoRA adapter %d could not be read: %s", adapter_id, error)
                    self._news[2].append((adapter_id, str(error)))
        loaded, evicted, failed = (tuple(news) for news in self._news)
        self._news = ([], [], [])
        return {"loaded_loras": loaded, "evicted_loras": evicted, "failed_loras": failed}

    def _keep(self, adapter_id: int, weights: SlotWeights) -> None:
        """Holds an adapter's weights, dropping the least recently used beyond max_cpu_loras
        (but never one in a slot: a step may need to place it again no sooner than it left)."""
        self._host[adapter_id] = weights
        self._news[0].append(adapter_id)
        droppable = [i for i in self._host if i not in self.resident and i != adapter_id]
        while len(self._host) > self.max_cpu_loras and droppable:
            evicted = droppable.pop(0)
            del self._host[evicted]
            self._news[1].append(evicted)

    def _read_files(self, request: LoRARequest) -> SlotWeights:
        return self._read(read_adapter(request.lora_path, request.lora_name, self.config, max_rank=self.max_rank))

    def _weights(self, request: LoRARequest) -> SlotWeights:
        adapter_id = request.lora_int_id
        if adapter_id not in self._host:
            future = self._reading.pop(adapter_id, None)
            self._keep(adapter_id, future.result() if future is not None else self._read_files(request))
        self._host.move_to_end(adapter_id)
        return self._host[adapter_id]

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _read(self, facts: AdapterFacts) -> SlotWeights:
        """Each adapted layer's slot contents (this rank's shard, scaled, zero-padded)."""
        weights: SlotWeights = {}
        some_stack = next(iter(self.stacks.values()))
        dtype = some_stack.a.dtype
        with safe_open(str(facts.weights_file), framework="pt") as file:
            for (layer, name), stack in self.stacks.items():
                if not any((layer, module) in facts.targets for module in stack.modules):
                    continue
                a = torch.zeros(stack.a.shape[1:], dtype=dtype)
                b = torch.zeros(stack.b.shape[1:], dtype=dtype)
                column = 0
                for index, module in enumerate(stack.modules):
                    width = stack.slices[index]
                    if (layer, module) in facts.targets:
                        a_name, b_name = facts.targets[layer, module]
                        a_full, b_full = file.get_tensor(a_name).float(), file.get_tensor(b_name).float()
                        start, stop = self._local_range(module)
                        if module in _ROW_PARALLEL:
                            a_full = a_full[:, start:stop]
                        else:
                            b_full = b_full[start:stop]
                        a[:, index * self.max_rank:index * self.max_rank + facts.rank] = a_full.T.to(dtype)
                        b[:facts.rank, column:column + width] = (b_full * facts.scaling).T.to(dtype)
                    column += width
                if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                    # the adapter's rows would turn every logit of its requests into NaN
                    raise ValueError(f"layer {layer}'s {name} weights hold NaN or infinite values in {dtype} "
                                     f"(scaled by lora_alpha / r = {facts.scaling:g})")
                weights[layer, name] = (a, b)
        return weights
