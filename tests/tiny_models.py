"""Builders of tiny random Hugging Face models with a locally trained BPE tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    BertConfig,
    BertModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    XLMRobertaConfig,
    XLMRobertaModel,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Structured concurrency keeps every task inside a nursery that outlives it.",
    "A paged key-value cache stores attention keys in fixed-size blocks of tokens.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Numbers like 12345 and 67890 appear in text, as do symbols: #, $, %, &.",
    "héllo wörld, ça va? 世界 你好 🙂 — unicode splits across byte-level tokens.",
    "def add(a, b):\n    return a + b\n",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 2}),
    # a window every layer of 24 tokens (a block and a half), which the longest prompt crosses
    "mistral": (MistralConfig, MistralForCausalLM, {"num_key_value_heads": 1, "sliding_window": 24}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"num_key_value_heads": 2}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"num_key_value_heads": 2, "head_dim": 32}),
    # windows of 12 tokens (less than a block) on every other layer / two layers of three, so
    # the prompts of up to 64 tokens cross them; soft caps low enough to bite at these scales
    # fused qkv / gate_up tensors; longrope over a pretraining length of 100, which no test
    # sequence crosses (past it transformers recomputes the whole sequence with the long
    # factors, triode rotates each position by its own: test_hf_reference checks the factors
    # themselves); a window of 30 on every layer
    "phi3": (Phi3Config, Phi3ForCausalLM, {
        "num_key_value_heads": 2, "original_max_position_embeddings": 100, "sliding_window": 30,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0 + 0.1 * i for i in range(8)],
                            "long_factor": [1.0 + 0.5 * i for i in range(8)]},
    }),
    # 8 experts, top 2, so routing varies from token to token; Qwen3-MoE's second layer dense
    "mixtral": (MixtralConfig, MixtralForCausalLM, {
        "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48,
    }),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 40, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    }),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {
        "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
        "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "tie_word_embeddings": True,
    }),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 3, "query_pre_attn_scalar": 24,
        "sliding_window": 12, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
        "tie_word_embeddings": True,
    }),
}


def train_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    directory: Path,
    architecture: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    seed: int = 0,
    **overrides,
) -> Path:
    config_class, model_class, extra = ARCHITECTURES[architecture]
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    settings.update(extra)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


ENCODERS = {"bert": (BertConfig, BertModel, {}),
            # XLM-R's positions start past its padding id: 128 usable of max_position_embeddings
            "xlm-roberta": (XLMRobertaConfig, XLMRobertaModel, {"max_position_embeddings": 128 + 3})}


def build_tiny_encoder(directory: Path, family: str, tokenizer: PreTrainedTokenizerFast, *, seed: int = 0) -> Path:
    """A tiny random BertModel or XLMRobertaModel checkpoint (128 positions) with ``tokenizer``."""
    config_class, model_class, extra = ENCODERS[family]
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                    initializer_range=0.1)
    torch.manual_seed(seed)
    model_class(config_class(**{**settings, **extra})).eval().save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


ST_MODES = {"MEAN": "pooling_mode_mean_tokens", "LAST": "pooling_mode_lasttoken", "CLS": "pooling_mode_cls_token"}


def with_sentence_transformers_files(source: Path, target: Path, pooling: str, *, normalize: bool = True) -> Path:
    """A copy of ``source``'s checkpoint with sentence-transformers' Transformer, Pooling and
    (``normalize``) Normalize modules."""
    target.mkdir()
    for item in source.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
    hidden = json.loads((source / "config.json").read_text())["hidden_size"]
    kinds = ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    paths = ["", "1_Pooling", "2_Normalize"]
    (target / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": paths[i], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(kinds)]))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in ST_MODES.items()}}))
    if normalize:
        (target / "2_Normalize").mkdir()
    return target
