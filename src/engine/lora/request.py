"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from typing import Any

import attrs

from triode.engine.errors import InvalidRequestError

__all__ = ["LoRARequest"]


def _positive_id(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"lora_int_id: must be an int >= 1 (0 is the base model), got {value!r}",
                                  field="lora_request")


def _text(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{attribute.name}: must be a non-empty string, got {value!r}",
                                  field="lora_request")


@attrs.frozen
class LoRARequest:
    """An adapter by name, a positive id unique among the adapters in use (the engine keys its
    caches by it: two requests with one id share one adapter's weights and KV), and the
    directory of its PEFT files (``adapter_config.json`` and ``adapter_model.safetensors``).
    Positional as in vLLM: ``LoRARequest("sql", 1, "/adapters/sql")``."""

    lora_name: str = attrs.field(validator=_text)
    lora_int_id: int = attrs.field(validator=_positive_id)
    lora_path: str = attrs.field(validator=_text)
    base_model_name: str | None = attrs.field(default=None, kw_only=True)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
