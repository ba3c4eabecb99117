"""A pooling model's embeddings, from the hidden states of the steps that ran its prompt.

A prompt may run in several chunks (chunked prefill), so the pooler keeps what it needs
between them: the running sum and count of the hidden states (MEAN), the first token's (CLS);
the last token's is in the chunk that ends the prompt (LAST). When that chunk has run, the
embedding is cut to the request's ``dimensions`` (Matryoshka), then L2-normalized where the
request or the model's pooling says so, in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triode.engine.model.pooling import PoolerConfig
from triode.engine.pooling_params import PoolingParams
from triode.engine.worker.step_inputs import StepInputs
from triode.engine.worker_messages import PooledOutput, ScheduledChunk


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._sums: dict[str, torch.Tensor] = {}  # MEAN: the hidden states' running sum
        self._firsts: dict[str, torch.Tensor] = {}  # CLS: the first token's

    def forget(self, seq_id: str) -> None:
        self._sums.pop(seq_id, None)
        self._firsts.pop(seq_id, None)

    def pool(self, chunks: list[ScheduledChunk], inputs: StepInputs, hidden: torch.Tensor,
             params: dict[str, PoolingParams]) -> tuple[PooledOutput, ...]:
        """The embeddings of the sequences whose prompt ends in this step (``chunk.sample``)."""
        kind = self.config.pooling_type
        pooled = []
        for index, chunk in enumerate(chunks):
            first, last = inputs.first_token_rows[index], inputs.last_token_rows[index]
            seq_id = chunk.seq_id
            if kind == "MEAN":
                total = hidden[first:last + 1].float().sum(dim=0)
                self._sums[seq_id] = total if seq_id not in self._sums else self._sums[seq_id] + total
            elif kind == "CLS" and chunk.start_position == 0:
                self._firsts[seq_id] = hidden[first].float()
            if not chunk.sample:
                continue
            if kind == "MEAN":
                vector = self._sums.pop(seq_id) / (chunk.start_position + last - first + 1)
            elif kind == "CLS":
                vector = self._firsts.pop(seq_id)
            else:
                vector = hidden[last].float()
            pooled.append(PooledOutput(seq_id, tuple(self._finish(vector, params[seq_id]).tolist())))
        return tuple(pooled)

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, dim=-1) if normalize else vector
