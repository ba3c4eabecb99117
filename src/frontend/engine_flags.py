"""Command-line flags for every EngineArgs field, generated from the class so the CLI, the
Python API and the TRIODE_* variables share one set of names and defaults."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from triode.engine.config import EngineArgs, parse_size

_HELP = {
    "model": "Hugging Face directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)",
    "served_model_name": "the model name clients send and see (default: the model argument)",
    "dtype": "weights and KV cache dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    "quantization": "quantize a float checkpoint's weights at load (cached) and run them with the CPU "
                    "kernels: int8 (Q8_0 blocks) or int4 (Q4_1 layers, Q8_0 embedding and LM head)",
    "quantized_activations": "what quantized weights multiply on a CPU: float32 activations (closest to "
                             "the dequantized model), int8 per 32 values as llama.cpp (fastest, lossy) or "
                             "15-bit integers (int16: CPUs with AVX2); auto: int16 where the CPU has the "
                             "interleaved kernels (AVX2 and a C compiler), float32 elsewhere",
    "kv_cache_memory": "KV-cache budget per rank, bytes or with a unit (e.g. 2GiB); default: sized from "
                       "the memory left once the weights are in (--gpu-memory-utilization)",
    "gpu_memory_utilization": "where --kv-cache-memory is not given, the share of memory the weights and "
                              "KV cache may fill: of the device's memory on a GPU (default 0.9), of the "
                              "memory available on a CPU, shared by the ranks (default 0.5)",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step (the scheduler's token budget)",
    "long_prefill_token_threshold": "chunk any prefill longer than this many tokens",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "async_scheduling": "plan each step while the one before it runs on the workers (default: on for "
                        "GPU workers, off for CPU workers, which use every core)",
    "enforce_eager": "capture no CUDA graphs: run every decode step kernel by kernel",
    "batch_invariant": "compute each token in an order independent of its step's batch, so that a "
                       "recomputed sequence gets the same logprobs bit for bit (slower past a few "
                       "sequences); refused where the device has no such kernels",
    "step_timeout": "seconds a worker step may take before the worker is restarted",
    "shutdown_timeout": "seconds to let in-flight requests finish on shutdown",
    "max_queued_requests": "requests waiting for intake before new ones get 503",
    "generation_config": "auto: the model's generation_config.json sampling defaults apply to "
                         "requests that leave them unset; vllm: they do not; or a folder",
    "reasoning_parser": "deepseek_r1 or qwen3: <think> goes to the message's reasoning field, and "
                        "structured outputs constrain only the answer after it",
    "structured_outputs_compile_timeout": "seconds a request's JSON schema, regex or grammar may "
                                          "take to compile before it is refused with 400",
    "cache_dir": "where converted models are cached (default: $TRIODE_CACHE or ~/.cache/triode)",
    "runner": "generate or pooling (embeddings); auto: pooling for a bare decoder checkpoint "
              "(Qwen3Model...), generate otherwise",
    "convert": "embed: run a causal LM as an embedding model (its LM head dropped); auto: when "
               "--runner pooling asks for it",
    "pooler_config": "how a pooling model pools, a JSON object such as '{\"pooling_type\": \"MEAN\", "
                     "\"normalize\": true}' (default: its sentence-transformers files, else the last "
                     "token, normalized)",
    "kv_events_config": "publish the prefix cache's events for cache-aware routers, as vLLM: a JSON object "
                        "such as '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}'",
    "enable_lora": "serve LoRA adapters chosen per request (--lora-modules, /v1/load_lora_adapter, "
                   "LoRARequest), batched with the base model's requests",
    "max_loras": "most LoRA adapters in one step (each a slot of weights in every worker)",
    "max_lora_rank": "highest rank of a LoRA adapter (its weights' slots are this wide)",
    "max_cpu_loras": "LoRA adapters kept read in each worker's host memory (default: --max-loras)",
    "speculative_config": "speculative decoding, as vLLM: a JSON object such as '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}', or with \"model\": a "
                          "draft model; outputs stay exactly the model's",
}


def size_argument(text: str) -> int:
    """Bytes from a size flag's text; a wrong one is reported with the reason (argparse says
    only "invalid ... value" for a ValueError)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_engine_flags(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    defaults = EngineArgs()
    for field in attrs.fields(EngineArgs):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        described = _HELP.get(field.name, field.name.replace('_', ' '))
        # a help text that names its own default (a variable, the model's limit) says it once
        help_text = described if "(default" in described else f"{described} (default: {default})"
        kind = str(field.type)
        if kind.startswith("bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif field.name == "kv_cache_memory":
            parser.add_argument(flag, type=size_argument, default=None, help=help_text)
        else:
            converter = int if kind.startswith("int") else float if kind.startswith("float") else str
            parser.add_argument(flag, type=converter, default=None, help=help_text)


def engine_args_from(namespace: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """Flags given on the command line win over TRIODE_* variables, which win over defaults."""
    given = {
        field.name: getattr(namespace, field.name)
        for field in attrs.fields(EngineArgs)
        if getattr(namespace, field.name, None) is not None
    }
    return EngineArgs.from_env(**{**given, **overrides})
