"""The model runner: owns the weights and the paged KV cache of one rank and executes a
StepPlan. It runs inside a worker process, so it imports neither trio nor the frontend.

Under tensor parallelism (a ``Rendezvous`` given) every rank runs the same plan through its
shard of the model; the collectives inside the model keep them in lockstep, and only rank 0
gets logits, samples and returns tokens. Every rank keeps the same sequences and block
tables; the KV cache of a rank holds its own KV heads, and every rank has the same number of
blocks (sized by the rank with the most KV heads, within the per-rank ``kv_cache_memory``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from triode.engine.config import EngineArgs
from triode.engine.errors import ModelLoadError
from triode.engine.model.config import ModelConfig
from triode.engine.model.pooling import read_pooler_config, resolve_runner
from triode.engine.model_files.layout import load_hf_config
from triode.engine.pooling_params import PoolingParams
from triode.engine.tensor_parallel import Rendezvous
from triode.engine.worker.block_tables import BlockTables
from triode.engine.worker.cuda_graphs import DecodeGraphs, GraphCapture, capture_decode_graphs
from triode.engine.worker.distributed import Partition, TensorParallelGroup, peak_resident_bytes
from triode.engine.worker.grammar import SequenceGrammars
from triode.engine.worker.host_memory import zeroed_tensor
from triode.engine.worker.input_staging import InputStaging
from triode.engine.worker.kv_budget import (
    MemoryReading,
    blocks_for_budget,
    check_given_budget,
    read_memory,
    size_kv_cache,
)
from triode.engine.worker.kv_pages import kv_pages_for
from triode.engine.worker.lora import WorkerLoRAs
from triode.engine.worker.models.llama import checkpoint_slices
from triode.engine.worker.placement import (
    load_weights,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from triode.engine.worker.pooler import Pooler
from triode.engine.worker.row_sampling import RowSampling
from triode.engine.worker.sampler import Sampler, prompt_logprobs_of_step
from triode.engine.worker.sequence_table import SequenceTable, batch_order
from triode.engine.worker.speculation import (
    expand_drafts,
    propose_after_step,
    proposer_for,
)
from triode.engine.worker.step_inputs import StepInputs
from triode.engine.worker_messages import (
    AcceptedDrafts,
    SampledTokens,
    StepPlan,
    StepResult,
)

logger = logging.getLogger(__name__)

# How long a plan that only waits for LoRA reads (StepPlan.wait_for_loads) may hold the worker:
# a step planned behind it waits that long at most.
LORA_POLL_SECONDS = 0.02


class ModelRunner:
    """One rank's model and KV cache. Without ``rendezvous`` the runner is the whole model
    (no process group); with it, rank ``rank`` of ``rendezvous.world_size`` joins the group
    first (rank 0 passes the ``store`` it serves) and loads only its shard."""

    def __init__(
        self,
        args: EngineArgs,
        model_path: str | Path,
        *,
        rank: int = 0,
        rendezvous: Rendezvous | None = None,
        store=None,
        local_rank: int | None = None,
        decode_graph_capture: GraphCapture | None = None,
    ) -> None:
        """``decode_graph_capture``: how decode graphs are captured (tests pass ``EagerReplay``
        to run the captured path on a CPU); by default CUDA graphs on a GPU unless
        ``enforce_eager``, none elsewhere."""
        path = Path(model_path)
        self.device = resolve_device(args.device)
        if rendezvous is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", rank if local_rank is None else local_rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        hf_config = load_hf_config(path)
        self.config = ModelConfig.from_hf(hf_config, source=str(path / "config.json"))
        self.runner = resolve_runner(hf_config.get("architectures") or [], runner=args.runner, convert=args.convert,
                                     source=str(path / "config.json"))
        # A pooling model embeds its prompts: no LM head, no sampling, no decode graphs.
        self.pooler = (Pooler(read_pooler_config(path, args.pooler_config, encoder=self.config.encoder))
                       if self.runner == "pooling" else None)
        self.max_model_len = resolve_max_model_len(self.config, args.max_model_len)
        self.block_size = args.block_size
        self.rank = rank
        self.parallel: TensorParallelGroup | None = None
        kv_heads = self.config.num_kv_heads
        select = None
        tensor_parallel = rendezvous is not None and rendezvous.world_size > 1
        # Decode graphs keep one KV block for their padding rows. Not under tensor
        # parallelism: every rank would have to replay in lockstep (not built yet).
        wants_graphs = not tensor_parallel and self.pooler is None and (
            decode_graph_capture is not None or (self.device.type == "cuda" and not args.enforce_eager))
        self._reserved_blocks = int(wants_graphs)
        # Blocks are sized by the rank with the most KV heads, so that every rank has as many.
        max_kv_heads = kv_heads
        # An explicit budget is checked first: a rank that fails before joining fails the
        # group at once. An automatic one is measured once the weights are in.
        self.kv_cache_memory = args.kv_cache_memory
        self.kv_cache_sizing = "given as kv_cache_memory"
        if tensor_parallel:
            partition = Partition.of(self.config, rank, rendezvous.world_size)
            max_kv_heads = partition.max_kv_heads
            if self.kv_cache_memory is not None:
                self._size_blocks(args, max_kv_heads)
            kv_heads = partition.num_kv_heads
            select = checkpoint_slices(self.config, partition)
            self.parallel = TensorParallelGroup.join(partition, rendezvous, self.device, store)
        elif self.kv_cache_memory is not None:
            self._size_blocks(args, max_kv_heads)
        self.model, self.quantized = load_weights(
            path, args, self.config, device=self.device, dtype=self.dtype, max_positions=self.max_model_len,
            select=select, parallel=self.parallel, head=self.pooler is None)
        self.loras: WorkerLoRAs | None = None
        if args.enable_lora:
            if self.pooler is not None:
                raise ModelLoadError("LoRA adapters apply to generation models; this one is a pooling model "
                                     "(drop --enable-lora)", path=str(path))
            self.loras = WorkerLoRAs(self.model, self.config, max_loras=args.max_loras, max_rank=args.max_lora_rank,
                                     max_cpu_loras=args.resolved_max_cpu_loras(),
                                     dtype=torch.bfloat16 if self.quantized else self.dtype,
                                     partition=self.parallel.partition if self.parallel is not None else None)
        # Peak resident memory once the weights are in (before the KV cache): what loading
        # this rank's shard cost, for `triode bench tp`.
        self.weights_peak_rss_bytes = peak_resident_bytes()
        if self.kv_cache_memory is None:
            self.kv_cache_memory, self.kv_cache_sizing, reading = size_kv_cache(
                args, device=self.device, config=self.config, dtype=self.dtype, kv_heads=max_kv_heads,
                max_model_len=self.max_model_len, reserved_blocks=self._reserved_blocks, parallel=self.parallel)
            self._size_blocks(args, max_kv_heads, reading)
        elif not self.config.encoder:
            sharing = self.parallel.size if self.parallel is not None and self.device.type == "cpu" else 1
            if warning := check_given_budget(self.kv_cache_memory, read_memory(self.device.type, self.device.index),
                                             ranks_sharing=sharing):
                logger.warning("%s", warning)
        # An encoder keeps no KV: its blocks only count what the scheduler admits.
        blocks = 0 if self.config.encoder else self.num_blocks + self._reserved_blocks
        shape = (blocks, self.block_size, kv_heads, self.config.head_dim)
        self.kv_caches = [(zeroed_tensor(shape, self.dtype, self.device), zeroed_tensor(shape, self.dtype, self.device))
                          for _ in range(self.config.num_layers)]
        self._kv_pages = kv_pages_for(self.kv_caches)
        self.sampler = Sampler(args.seed)
        # Only rank 0 samples, so only it follows grammars (built on first use).
        self.grammars = SequenceGrammars(path / "tokenizer.json", self.config.vocab_size,
                                         reasoning_parser=args.reasoning_parser) \
            if rank == 0 and self.pooler is None else None
        self._grammar_seconds = 0.0
        self.speculative = args.speculative_config
        if self.speculative is not None and self.pooler is not None:
            raise ModelLoadError("speculative decoding applies to generation models; this one is a pooling "
                                 "model (drop --speculative-config)", path=str(path))
        self.proposer = proposer_for(args, rank=rank, device=self.device, dtype=self.dtype,
                                     max_model_len=self.max_model_len, budget_bytes=self._draft_kv_bytes,
                                     block_size=self.block_size)
        self.table = SequenceTable(
            BlockTables(-(-self.max_model_len // self.block_size), rows=args.max_num_seqs), grammars=self.grammars,
            keepers=(self.pooler, self.proposer), proposer=self.proposer)
        self.sequences, self.block_tables = self.table.sequences, self.table.block_tables
        self._step_speculates = False
        self._sample_seconds = 0.0
        self.graphs: DecodeGraphs | None = None
        if wants_graphs:
            self.graphs = capture_decode_graphs(
                self._logits_of_step, max_num_seqs=args.max_num_seqs, max_model_len=self.max_model_len,
                block_size=self.block_size, scratch_block=self.num_blocks, device=self.device,
                capture=decode_graph_capture,
            )
        elif self.device.type == "cuda" and tensor_parallel and not args.enforce_eager:
            logger.info("decode steps run eagerly under tensor parallelism (no CUDA graphs)")
        # On a GPU a step's inputs go up in one copy; on a CPU they are already where they run.
        self._staging = InputStaging(self.device) if self.device.type != "cpu" else None
        # With plans made ahead every rank feeds sequences the tokens rank 0 sampled, so under
        # tensor parallelism rank 0 broadcasts them each step (one small collective).
        self.row_sampling = RowSampling(
            self.sampler, self.sequences, vocab_size=self.config.vocab_size, device=self.device,
            grammars=self.grammars, parallel=self.parallel, verifies=self.proposer is not None,
            follows_samples=self.parallel is not None and args.async_scheduling_on(str(self.device)))

    def _size_blocks(self, args: EngineArgs, kv_heads: int, reading: MemoryReading | None = None) -> None:
        assert self.kv_cache_memory is not None
        self.num_blocks, self._draft_kv_bytes = blocks_for_budget(
            self.kv_cache_memory, args, config=self.config, dtype=self.dtype, kv_heads=kv_heads,
            max_model_len=self.max_model_len, reserved_blocks=self._reserved_blocks, reading=reading)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        self.row_sampling.grammar_seconds = self.row_sampling.prepare_seconds = 0.0
        self._grammar_seconds = self.table.apply(plan)
        chunks, chunk_tokens = plan.chunks, self.table.chunk_tokens(plan.chunks)
        drafts = None
        if self.speculative is not None:
            chunks, chunk_tokens, drafts = expand_drafts(chunks, chunk_tokens)
            self._step_speculates = drafts is not None or any(chunk.propose for chunk in plan.chunks)
        adapters = self.table.adapters(chunks) if self.loras is not None else None
        chunks, chunk_tokens, adapters = batch_order(chunks, chunk_tokens, adapters)
        self.block_tables.extend_many((chunk.seq_id, chunk.new_block_ids) for chunk in chunks if chunk.new_block_ids)
        if self._kv_pages is not None:
            self._kv_pages.commit_through(self.block_tables.highest_block)
        if self.loras is not None and plan.load_loras:
            self.loras.prefetch(plan.load_loras)
        if not chunks:
            if self.loras is not None and plan.wait_for_loads:
                self.loras.wait_for_reads(LORA_POLL_SECONDS)
            return StepResult(step_id=plan.step_id, **self._lora_news())
        inputs = StepInputs.build(chunks, chunk_tokens, self.block_tables, block_size=self.block_size,
                                  device=self.device, staging=self._staging)
        if self.parallel is not None:
            self.parallel.collective_seconds = 0.0
        self._prepare_seconds = time.perf_counter() - started
        if adapters is not None:
            self.loras.begin_step([adapter for adapter, tokens in zip(adapters, chunk_tokens, strict=True)
                                   for _ in tokens])
        self._sample_seconds = 0.0
        forward_started = time.perf_counter()
        try:
            (sampled, accepted), prompt_logprobs, pooled = self._run(chunks, inputs, lora=adapters is not None,
                                                                      drafts=drafts)
        finally:
            if adapters is not None:
                self.loras.end_step()
        return StepResult(
            step_id=plan.step_id,
            sampled=sampled,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
            accepted=accepted,
            proposals=(propose_after_step(self.proposer, plan.chunks, self.sequences)
                       if self._step_speculates and self.proposer is not None else ()),
            execute_seconds=time.perf_counter() - started,
            grammar_seconds=self._grammar_seconds + self.row_sampling.grammar_seconds,
            collective_seconds=self.parallel.collective_seconds if self.parallel is not None else 0.0,
            prepare_seconds=self._prepare_seconds + self.row_sampling.prepare_seconds,
            forward_seconds=time.perf_counter() - forward_started - self._sample_seconds,
            sample_seconds=self._sample_seconds,
            **self._lora_news(),
        )

    def _lora_news(self) -> dict[str, tuple]:
        return self.loras.take_news() if self.loras is not None else {}

    def _run(self, chunks, inputs: StepInputs, *, lora: bool, drafts: dict[str, tuple[int, ...]] | None):
        """((sampled, accepted proposals), prompt logprobs, pooled) of the step; ``lora``: some
        rows have an adapter (captured decode graphs have none); ``drafts``: the proposals
        the step's verifying sequences feed (``speculation.expand_drafts``)."""
        if self.pooler is not None:
            hidden = self.model(inputs.token_ids, inputs.positions, self.kv_caches, inputs.metadata)
            params = {c.seq_id: self.sequences[c.seq_id].pooling or PoolingParams() for c in chunks}
            return (SampledTokens(), ()), (), self.pooler.pool(chunks, inputs, hidden, params)
        # a decode graph keeps no hidden states, which prompt logprobs need
        if not lora and self.graphs is not None and self.graphs.takes(inputs.metadata) and all(
                self.sequences[c.seq_id].params.prompt_logprobs is None for c in chunks):
            logits = self.graphs.run(inputs.token_ids, inputs.positions, inputs.metadata)
            return self._sample(chunks, inputs, logits=logits, drafts=drafts), (), ()
        hidden = self.model(inputs.token_ids, inputs.positions, self.kv_caches, inputs.metadata)
        sampled = self._sample(chunks, inputs, hidden=hidden, drafts=drafts)
        return sampled, prompt_logprobs_of_step(self.model, chunks, inputs, hidden, self.sequences), ()

    def _logits_of_step(self, token_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        """Every row's logits: what a decode graph captures."""
        return self.model.compute_logits(self.model(token_ids, positions, self.kv_caches, metadata))

    def _sample(self, chunks, inputs: StepInputs, *, hidden: torch.Tensor | None = None,
                logits: torch.Tensor | None = None, drafts: dict[str, tuple[int, ...]] | None = None,
                ) -> tuple[SampledTokens, tuple[AcceptedDrafts, ...]]:
        """(sampled, accepted proposals) of the chunks that sample, from the step's ``hidden``
        states, or from ``logits`` of every row (a decode graph's)."""
        sampling = [i for i, chunk in enumerate(chunks) if chunk.sample]
        if not sampling:
            return SampledTokens(), ()
        rows = logits if logits is not None else hidden
        if len(sampling) != rows.shape[0]:  # not every row samples (a prefill chunk's do not)
            rows = rows.index_select(0, torch.tensor([inputs.last_token_rows[i] for i in sampling],
                                                     device=self.device))
        logits = rows if logits is not None else self.model.compute_logits(rows)
        started, prepared = time.perf_counter(), self.row_sampling.prepare_seconds
        try:
            return self.row_sampling.sample(logits, [chunks[i].seq_id for i in sampling], drafts,
                                    speculates=self._step_speculates)
        finally:  # the sampling batch's rows are counted as preparation, not here
            self._sample_seconds += time.perf_counter() - started - (self.row_sampling.prepare_seconds - prepared)

    def close(self) -> None:
        """Leaves the process group (if any)."""
        if self.loras is not None:
            self.loras.close()
        if self.parallel is not None:
            self.parallel.leave()
            self.parallel = None
