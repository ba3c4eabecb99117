"""Architecture name -> model class, and the one place a model is built and loaded."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from triode.engine.errors import UnsupportedModelError
from triode.engine.model.config import GEMMA, SUPPORTED_ARCHITECTURES, ModelConfig
from triode.engine.model.pooling import ENCODERS
from triode.engine.worker.distributed import TensorParallelGroup
from triode.engine.worker.models.bert import BertModel
from triode.engine.worker.models.fused_checkpoint import unfuse, unfused_names
from triode.engine.worker.models.gemma import GemmaForCausalLM
from triode.engine.worker.models.llama import LlamaForCausalLM, checkpoint_slices

_MODELS: dict[str, type[nn.Module]] = {
    **dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM),
    # a Gemma3ForConditionalGeneration checkpoint is read as its text model, Gemma3ForCausalLM
    **dict.fromkeys((*GEMMA, "Gemma3ForConditionalGeneration"), GemmaForCausalLM),
    **dict.fromkeys(ENCODERS, BertModel),
}


def _under(weights: Iterable[tuple[str, torch.Tensor]], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors named under ``prefix``, without it: a multimodal checkpoint's text model."""
    for name, tensor in weights:
        if name.startswith(prefix):
            yield name.removeprefix(prefix), tensor


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    source: str,
    parallel: TensorParallelGroup | None = None,
    quantized: Mapping[str, str] | None = None,
    head: bool = True,
) -> nn.Module:
    """Builds the model without initialising parameters (they are overwritten by the load).
    With ``parallel``, the model holds that rank's shard and ``weights`` must yield the
    slices ``checkpoint_slices`` names (the loader reads only those). ``quantized`` (tensor
    name -> block type) names the checkpoint's quantized tensors to keep as they are; other
    quantized tensors are dequantized as they load. ``head``: False for a pooling model (no
    LM head is built, and a checkpoint's is not read)."""
    model_class = _MODELS.get(config.architecture)
    if model_class is None:
        raise UnsupportedModelError(
            f"no implementation for {config.architecture}; supported: {', '.join(_MODELS)}",
            path=source,
        )
    slice_of = checkpoint_slices(config, parallel.partition) if parallel is not None else None
    if config.weights_prefix:
        weights = _under(weights, config.weights_prefix)
    weights = unfuse(weights, config, slice_of=slice_of, source=source)
    with torch.device("meta"):
        model = model_class(config, max_positions=max_positions, parallel=parallel, head=head)
        if quantized:
            model.keep_quantized(unfused_names(quantized, config))
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        model.load_weights(weights, source=source)
    model.pack_linear_weights()
    model.init_rope()
    return model.eval()
