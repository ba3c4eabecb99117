"""The encoder family: BERT and XLM-RoBERTa (``BertModel``, ``XLMRobertaModel``), the models
behind most sentence-embedding checkpoints (MiniLM, bge, e5, multilingual ones).

Every token attends to every token of its prompt (no causal mask), so a prompt runs whole in
one step (the scheduler never cuts an encoder's prompt) and no KV cache is kept: attention is
computed per sequence from the step's own keys and values. The modules carry transformers'
names, so a checkpoint's tensors load by name (``bert.`` / ``roberta.`` prefixes of task
checkpoints dropped, the unused pooler head skipped). Post-LayerNorm blocks, exact GELU, learned
absolute positions (from XLM-R's ``padding_idx + 1``), token type 0."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triode import kernels
from triode.engine.errors import ModelLoadError, UnsupportedModelError
from triode.engine.model.config import ModelConfig

_PREFIXES = ("bert.", "roberta.", "model.")


class _SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.hidden_size
        self.query, self.key, self.value = nn.Linear(size, size), nn.Linear(size, size), nn.Linear(size, size)


class _Output(nn.Module):
    def __init__(self, inputs: int, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class _Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _Output(config.hidden_size, config)


class _Intermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _Output(config.intermediate_size, config)

    def forward(self, hidden: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        attention = self.attention.self
        tokens = hidden.shape[0]
        shape = (tokens, self.num_heads, self.head_dim)
        q, k, v = (proj(hidden).view(shape).transpose(0, 1) for proj in (attention.query, attention.key,
                                                                          attention.value))
        context = torch.empty_like(q)
        for start, end in bounds:  # each prompt attends to itself, whole
            context[:, start:end] = F.scaled_dot_product_attention(q[:, start:end], k[:, start:end], v[:, start:end])
        hidden = self.attention.output(context.transpose(0, 1).reshape(tokens, -1), hidden)
        return self.output(F.gelu(self.intermediate.dense(hidden)), hidden)


class _Embeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(1, config.hidden_size)  # type 0: the only one read
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.offset = config.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.offset)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])



class BertModel(nn.Module):
    """Also serves XLMRobertaModel. ``forward`` takes the runner's step (the KV caches go
    unused) and returns every token's final hidden state."""

    def __init__(self, config: ModelConfig, *, max_positions: int, parallel: Any = None, head: bool = False) -> None:
        super().__init__()
        if parallel is not None:
            raise UnsupportedModelError(f"{config.architecture} runs on one rank (no tensor parallelism)")
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any,
                metadata: kernels.AttentionMetadata) -> torch.Tensor:
        starts = metadata.query_start_loc_host
        bounds = list(itertools.pairwise(starts))
        if any(end - start != length for (start, end), length in zip(bounds, metadata.seq_lens_host, strict=True)):
            raise RuntimeError("an encoder runs each prompt whole, in one step")
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, bounds)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, Any]], *, source: str) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = next((hf_name.removeprefix(p) for p in _PREFIXES if hf_name.startswith(p)), hf_name)
            if name.startswith(("pooler.", "cls.", "lm_head.")) or name == "embeddings.position_ids":
                continue  # heads a pooling model does not run, and a buffer
            if isinstance(tensor, kernels.QuantizedWeight):
                tensor = tensor.dequantize()
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"unexpected tensor {hf_name!r} in the checkpoint", path=source)
            if name == "embeddings.token_type_embeddings.weight":
                tensor = tensor[:1]  # a checkpoint may have more types; only type 0 is read
            if param.shape != tensor.shape:
                raise ModelLoadError(f"tensor {hf_name!r} has shape {list(tensor.shape)}, expected "
                                     f"{list(param.shape)}", path=source)
            param.data.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"the checkpoint lacks {', '.join(missing[:5])}", path=source)

    def pack_linear_weights(self) -> None:
        """Nothing to pack: the encoder runs torch's own linear layers."""

    def init_rope(self) -> None:
        """Nothing to build: positions are learned embeddings."""
