"""What both engines learn about the model in the engine process before the workers load it:
where it is (resolved and, for GGUF, converted), its tokenizer, and its generation settings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs

from triode.engine.config import EngineArgs
from triode.engine.inputs import (
    TOOL_TEMPLATE_NAME,
    InputProcessor,
    load_tokenizer,
    template_reads_tools,
)
from triode.engine.lora.adapters import LoRAAdapters
from triode.engine.model.config import ModelConfig
from triode.engine.model.generation_config import GenerationDefaults, read_generation_defaults
from triode.engine.model_files.layout import load_hf_config
from triode.engine.model_files.resolve import resolve_model
from triode.engine.structured.compiler import GrammarCompiler
from triode.engine.worker_messages import WorkerInfo

log = logging.getLogger("triode.engine")


@attrs.frozen(kw_only=True)
class EngineModel:
    path: Path
    tokenizer: Any  # transformers' PreTrainedTokenizerFast
    generation: GenerationDefaults


def open_engine_model(args: EngineArgs) -> EngineModel:
    """Resolves the model, loads its tokenizer and reads its generation settings (logged)."""
    path = resolve_model(args.model, cache_dir=args.resolved_cache_dir(), quantization=args.quantization).path
    tokenizer = load_tokenizer(path)
    generation = read_generation_defaults(
        path, mode=args.generation_config, tokenizer_eos_token_id=tokenizer.eos_token_id
    )
    log.info("generation config (--generation-config %s): %s", args.generation_config,
             generation.describe())
    return EngineModel(path=path, tokenizer=tokenizer, generation=generation)


def open_input_processor(model: EngineModel, args: EngineArgs, info: WorkerInfo) -> InputProcessor:
    """Request validation for this model as the workers loaded it, structured outputs included."""
    grammars = GrammarCompiler(
        model.path / "tokenizer.json", vocab_size=info.vocab_size,
        eos_token_ids=model.generation.eos_token_ids,
        timeout_s=args.structured_outputs_compile_timeout, reasoning_parser=args.reasoning_parser,
    )
    if model.tokenizer.chat_template and not template_reads_tools(model.tokenizer.chat_template):
        log.info("chat template: the model's own ignores tools; chats with tools use triode's %s",
                 TOOL_TEMPLATE_NAME)
    loras = None
    if args.enable_lora:
        config = ModelConfig.from_hf(load_hf_config(model.path), source=str(model.path / "config.json"))
        loras = LoRAAdapters(config, max_rank=args.max_lora_rank)
    return InputProcessor(model.tokenizer, max_model_len=info.max_model_len,
                          vocab_size=info.vocab_size, grammars=grammars, hidden_size=info.hidden_size, loras=loras)
