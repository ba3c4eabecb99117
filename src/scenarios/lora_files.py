"""Random LoRA adapters for scenarios that serve them (``lora_adapters`` in a workload): PEFT
files written once per run for the served model's shape, and the ``triode serve`` flags that
serve them under the names the clients send (``client.adapter_name``)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from triode.bench.lora import write_random_adapter
from triode.engine.config import EngineArgs
from triode.engine.model.config import ModelConfig
from triode.engine.model_files.layout import load_hf_config
from triode.engine.model_files.resolve import resolve_model
from triode.scenarios.client import adapter_name
from triode.scenarios.spec import Workload

# Big enough that an adapter changes most of the default model's greedy texts.
ADAPTER_SCALE = 0.1


class LoRAAdapterFiles:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self._directory: Path | None = None
        self._config: ModelConfig | None = None

    def server_args(self, workload: Workload) -> list[str]:
        """The flags that serve the workload's adapters (none for a workload without)."""
        if not workload.lora_adapters:
            return []
        modules = [f"{adapter_name(i)}={self._adapter(i, workload.lora_rank)}" for i in range(workload.lora_adapters)]
        return ["--enable-lora", "--max-loras", str(workload.lora_adapters), "--max-lora-rank",
                str(workload.lora_rank), "--lora-modules", *modules]

    def _adapter(self, index: int, rank: int) -> Path:
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="triode-scenario-lora-"))
        if self._config is None:
            args = EngineArgs(model=self.model)
            path = resolve_model(args.model, cache_dir=args.resolved_cache_dir()).path
            self._config = ModelConfig.from_hf(load_hf_config(path))
        directory = self._directory / f"rank{rank}-{index}"
        if not directory.exists():
            write_random_adapter(directory, self._config, rank=rank, seed=index, scale=ADAPTER_SCALE)
        return directory

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
