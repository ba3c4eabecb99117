"""The adapters an engine has checked: a ``LoRARequest``'s files are read and checked against
the model (``peft_files.read_adapter``) the first time its id is seen, and an id keeps naming
the adapter it first named (the engine's caches, KV included, are keyed by id)."""

from __future__ import annotations

import threading

from triode.engine.errors import InvalidRequestError
from triode.engine.lora.peft_files import AdapterFacts, read_adapter
from triode.engine.lora.request import LoRARequest
from triode.engine.model.config import ModelConfig

__all__ = ["LoRAAdapters"]


class LoRAAdapters:
    """Checks the adapters requests name, for an engine started with ``enable_lora``."""

    def __init__(self, model: ModelConfig, *, max_rank: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self._checked: dict[int, tuple[LoRARequest, AdapterFacts]] = {}
        self._lock = threading.Lock()  # intake checks in worker threads

    def check(self, request: LoRARequest) -> AdapterFacts:
        """The adapter's facts (read once per id); raises ``LoRAAdapterError`` for files that
        cannot be served, ``InvalidRequestError`` for an id that named another adapter."""
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request: expected a LoRARequest, got {type(request).__name__}",
                                      field="lora_request")
        with self._lock:
            known = self._checked.get(request.lora_int_id)
        if known is None:
            facts = read_adapter(request.lora_path, request.lora_name, self.model, max_rank=self.max_rank)
            with self._lock:  # another thread may have checked the id meanwhile: the first one stays
                known = self._checked.setdefault(request.lora_int_id, (request, facts))
        first, facts = known
        if (first.lora_name, first.lora_path) != (request.lora_name, request.lora_path):
            raise InvalidRequestError(
                f"lora_request: lora_int_id {request.lora_int_id} names adapter {first.lora_name!r} at "
                f"{first.lora_path}; give {request.lora_name!r} at {request.lora_path} an id of its own",
                field="lora_request")
        return facts
