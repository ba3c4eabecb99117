"""Builders of random PEFT LoRA adapters for the tiny test models, saved as PEFT saves them."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(base: Path, directory: Path, *, rank: int, seed: int, targets=ALL_TARGETS, alpha: int | None = None,
                  use_rslora: bool = False, scale: float = 1.0) -> Path:
    """A LoRA adapter of ``base`` with random A and B (PEFT's ``init_lora_weights=False``; B
    would be zero otherwise), ``scale`` times PEFT's random values, so that it changes the
    model's greedy choices."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.mul_(scale)
    peft_model.save_pretrained(directory)
    return directory
