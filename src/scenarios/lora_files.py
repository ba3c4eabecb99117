"""Random LoRA adapters for scenarios that serve them (``lora_adapters`` in a workload): PEFT
files written once per run for the served model's shape, and the ``triode serve`` flags that
serve them under the names the clients send (``client.adapter_name``). The files are written by
``python -m triode.bench.lora`` in a process of its own: the runner imports nothing of the
runtime (it drives servers as a user would)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from triode.scenarios.client import adapter_name
from triode.scenarios.spec import Workload

# Big enough that an adapter changes most of the default model's greedy texts.
ADAPTER_SCALE = 0.1


class LoRAAdapterFiles:
    def __init__(self, model: str | None) -> None:
        self.model = model
        self._directory: Path | None = None

    def server_args(self, workload: Workload) -> list[str]:
        """The flags that serve the workload's adapters (none for a workload without)."""
        if not workload.lora_adapters:
            return []
        directories = self._adapters(workload.lora_adapters, workload.lora_rank)
        modules = [f"{adapter_name(i)}={directory}" for i, directory in enumerate(directories)]
        return ["--enable-lora", "--max-loras", str(workload.lora_adapters), "--max-lora-rank",
                str(workload.lora_rank), "--lora-modules", *modules]

    def _adapters(self, count: int, rank: int) -> list[Path]:
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix="triode-scenario-lora-"))
        directory = self._directory / f"rank{rank}"
        paths = [directory / f"adapter-{i}" for i in range(count)]
        if not all(path.exists() for path in paths):
            command = [sys.executable, "-m", "triode.bench.lora", str(directory), "--count", str(count),
                       "--rank", str(rank), "--scale", str(ADAPTER_SCALE)]
            if self.model:
                command += ["--model", self.model]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"writing the scenario's LoRA adapters failed ({' '.join(command)}):\n"
                                   f"{done.stderr[-2000:]}")
        return paths

    def close(self) -> None:
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
