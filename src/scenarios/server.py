"""A triode server under test: a real `triode serve` process on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import httpx2
import trio

_METRIC = re.compile(r'^(?P<name>[\w:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerExited(RuntimeError):
    """The server ended before it became healthy (a model that does not load, a bad option)."""


class ServerProcess:
    def __init__(self, args: Sequence[str], *, fault_plan: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        # the engine's test hook: its environment, not a serve flag (triode.engine.worker.faults)
        self.environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.environment.pop("TRIODE_FAULT_PLAN", None)
        if fault_plan:
            self.environment["TRIODE_FAULT_PLAN"] = fault_plan
        self._log = tempfile.TemporaryFile()
        self.process: trio.Process | None = None
        self.load_seconds = 0.0

    async def start(self, *, limit: float = 180.0) -> None:
        command = [sys.executable, "-m", "triode.frontend.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), *self.args]
        self.process = await trio.lowlevel.open_process(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=self.environment
        )
        started = trio.current_time()
        with trio.move_on_after(limit):
            while True:
                if self.process.poll() is not None:
                    raise ServerExited(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
                if await self.health() == 200:
                    self.load_seconds = trio.current_time() - started
                    return
                await trio.sleep(0.05)  # the start-up is the slow part, not this
        raise RuntimeError(f"the server did not become healthy in {limit}s:\n{self.log_tail()}")

    async def health(self) -> int:
        try:
            async with httpx2.AsyncClient(timeout=2.0) as client:
                return (await client.get(f"{self.base_url}/health")).status_code
        except httpx2.TransportError:
            return 0

    async def metrics(self) -> dict[str, float]:
        """Prometheus samples by metric name, summed over label sets (one model per server)."""
        async with httpx2.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"{self.base_url}/metrics")).text
        samples = {}
        for line in text.splitlines():
            match = _METRIC.match(line)
            if match and not match["name"].startswith("triode:worker_pid"):
                samples[match["name"]] = samples.get(match["name"], 0.0) + float(match["value"])
        return samples

    async def worker_pids(self) -> list[int]:
        """From the server's own statistics: the triode:worker_pid gauge, one per rank."""
        async with httpx2.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"{self.base_url}/metrics")).text
        return [int(float(m["value"])) for line in text.splitlines()
                if (m := _METRIC.match(line)) and m["name"] == "triode:worker_pid"]

    @property
    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    async def wait(self, limit: float) -> int | None:
        """The exit code, or None if the process still runs after ``limit`` seconds."""
        with trio.move_on_after(limit):
            await self.process.wait()
        return self.process.poll()

    async def stop(self) -> int | None:
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        code = await self.wait(60.0)
        if code is None:
            self.process.kill()
            code = await self.wait(10.0)
        self._log.close()
        return code

    def log_tail(self, lines: int = 30) -> str:
        if self._log.closed:
            return ""
        self._log.seek(0)
        return "\n".join(self._log.read().decode(errors="replace").splitlines()[-lines:])
