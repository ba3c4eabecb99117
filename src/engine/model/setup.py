"""What both engines learn about the model in the engine process before the workers load it:
where it is (resolved and, for GGUF, converted), its tokenizer, and its generation settings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs

from triode.engine.chat_options import TOOL_TEMPLATE_NAME, template_reads_tools
from triode.engine.config import EngineArgs
from triode.engine.errors import InvalidRequestError
from triode.engine.inputs import InputProcessor, load_tokenizer
from triode.engine.lora.adapters import LoRAAdapters
from triode.engine.model.config import ModelConfig
from triode.engine.model.generation_config import GenerationDefaults, read_generation_defaults
from triode.engine.model.pooling import resolve_runner
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
    args: EngineArgs  # for the workers: a draft model's path resolved (speculative_config.model)


def open_engine_model(args: EngineArgs) -> EngineModel:
    """Resolves the model (and a draft model, checked against it), loads its tokenizer and
    reads its generation settings (logged)."""
    path = resolve_model(args.model, cache_dir=args.resolved_cache_dir(), quantization=args.quantization).path
    tokenizer = load_tokenizer(path)
    generation = read_generation_defaults(
        path, mode=args.generation_config, tokenizer_eos_token_id=tokenizer.eos_token_id
    )
    log.info("generation config (--generation-config %s): %s", args.generation_config,
             generation.describe())
    return EngineModel(path=path, tokenizer=tokenizer, generation=generation,
                       args=_with_draft_model(args, path, tokenizer))


def _with_draft_model(args: EngineArgs, path: Path, tokenizer: Any) -> EngineArgs:
    """``args`` with the draft model's directory resolved, once it proposes in the target's
    vocabulary: a causal LM whose vocab_size and tokenizer are the target's."""
    spec = args.speculative_config
    if spec is None or spec.method != "draft_model":
        return args
    assert spec.model is not None
    draft = resolve_model(spec.model, cache_dir=args.resolved_cache_dir()).path

    def refuse(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"speculative_config.model: {message}", field="speculative_config")

    hf_config = load_hf_config(draft)
    if resolve_runner(hf_config.get("architectures") or [], runner="auto", convert="auto",
                      source=str(draft / "config.json")) != "generate":
        raise refuse(f"{spec.model} is not a generation model")
    target_vocab = ModelConfig.from_hf(load_hf_config(path), source=str(path / "config.json")).vocab_size
    draft_vocab = ModelConfig.from_hf(hf_config, source=str(draft / "config.json")).vocab_size
    if draft_vocab != target_vocab:
        raise refuse(f"the draft model's vocab_size is {draft_vocab}, the model's {target_vocab}: a draft must "
                     f"propose in the model's vocabulary")
    theirs, ours = load_tokenizer(draft).get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differing = len(set(theirs.items()) ^ set(ours.items())) // 2 or abs(len(theirs) - len(ours))
        raise refuse(f"the draft model's tokenizer differs from the model's ({differing} tokens have other ids "
                     f"or are missing): a draft must use the model's tokenizer")
    log.info("speculative decoding: draft model %s (%s)", spec.model, draft)
    return attrs.evolve(args, speculative_config=attrs.evolve(spec, model=str(draft)))


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
