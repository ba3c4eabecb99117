"""The LoRA adapters a server serves by name: those of ``--lora-modules``, checked at start-up,
and those loaded and unloaded at run time (``/v1/load_lora_adapter``). A request's ``model``
is the base model's name or an adapter's; ids are handed out once and never reused, so the
engine's caches (keyed by id) never mistake a reloaded adapter for the one it replaced."""

from __future__ import annotations

import itertools

from triode.engine.async_llm import AsyncLLM
from triode.engine.errors import InvalidRequestError
from triode.engine.lora.request import LoRARequest
from triode.frontend.openai.errors import APIError
from triode.frontend.server.settings import LoRAModule

__all__ = ["ServedAdapters"]


class ServedAdapters:
    def __init__(self, base_name: str, modules: tuple[LoRAModule, ...] = ()) -> None:
        self.base_name = base_name
        self._modules = modules
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def adapters(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    async def start(self, llm: AsyncLLM) -> None:
        """Checks every ``--lora-modules`` adapter against the loaded model: a bad one stops
        the start-up with its name and the reason."""
        if self._modules and not llm.args.enable_lora:
            raise InvalidRequestError("--lora-modules: serving adapters needs --enable-lora", field="lora_modules")
        for module in self._modules:
            if module.name == self.base_name:
                raise InvalidRequestError(f"--lora-modules: {module.name!r} is the base model's name",
                                          field="lora_modules")
            request = LoRARequest(module.name, next(self._ids), module.path, base_model_name=module.base_model_name)
            await llm.add_lora(request)
            self._by_name[module.name] = request

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or no name); 404
        listing what is served for any other name."""
        if model is None or model == self.base_name:
            return None
        adapter = self._by_name.get(model)
        if adapter is None:
            served = ", ".join(repr(name) for name in [self.base_name, *self._by_name])
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return adapter

    async def load(self, llm: AsyncLLM, name: str, path: str, *, in_place: bool = False) -> LoRARequest:
        """Serves a new adapter once its files pass the checks (their error is the caller's).
        ``in_place``: a name already served names the new files from now on (under a new id:
        requests running with the old ones finish with them)."""
        if name == self.base_name:
            raise APIError(400, f"lora_name: {name!r} is the base model's name", param="lora_name")
        self._check_free(name, in_place)
        request = LoRARequest(name, next(self._ids), path)
        await llm.add_lora(request)
        self._check_free(name, in_place)  # another load of the name may have finished meanwhile
        self._by_name[name] = request
        return request

    def _check_free(self, name: str, in_place: bool) -> None:
        if name in self._by_name and not in_place:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                f"adapter in place, set 'load_inplace' to True.", param="lora_name")

    def unload(self, name: str) -> LoRARequest:
        """Stops serving an adapter by name; requests already running with it finish."""
        request = self._by_name.pop(name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_adapter_not_found")
        return request
