"""Helpers for the HTTP tests: a real server process on 127.0.0.1 (``triode serve`` or
hypercorn) on a free port the server picks itself (``--port 0``; the URL is read from its
output), plus small clients for what the openai SDK does not reach (raw bodies, /metrics)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx2
import trio
from prometheus_client.parser import text_string_to_metric_families

BIN = Path(sys.executable).parent
_URL = re.compile(r"(?:triode: serving .* at|Running on) (http://[0-9.:]+)")


class ServerProcess:
    def __init__(self, command: Sequence[str], *, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> None:
        self.command = list(command)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and (match := _URL.search(line)):
                self.url = match.group(1)
                self._ready.set()
        self.process.stdout.close()
        self._ready.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 120) -> str:
        if not self._ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError(f"the server did not start: {self.command}\n{self.output}")
        return self.url

    def wait_exit(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(5)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """Kills the server's whole process group (its workers too), for failed tests."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def triode_serve(model: str | os.PathLike | None, *flags: str, env: dict[str, str] | None = None
                 ) -> ServerProcess:
    """``triode serve`` on a free port; ``model`` None serves the default model."""
    positional = [] if model is None else [str(model)]
    return ServerProcess([str(BIN / "triode"), "serve", *positional, "--host", "127.0.0.1", "--port", "0",
                          *flags], env=env)


@contextlib.contextmanager
def running(server: ServerProcess, timeout: float = 120) -> Iterator[ServerProcess]:
    try:
        server.wait_ready(timeout)
        yield server
    finally:
        if server.process.poll() is None:
            try:
                server.stop(timeout=60)
            except subprocess.TimeoutExpired:
                pass


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server that must be told its port)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return metric_in(httpx2.get(f"{url}/metrics", timeout=10).text, name, **labels)


def metric_in(text: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    assert found, f"no metric {name} {labels} in:\n{text}"
    return total


def wait_until(predicate, timeout: float = 20, interval: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def ametric(client, url: str, name: str, **labels: str) -> float:
    """``metric`` for trio tests, with an ``httpx2.AsyncClient``."""
    return metric_in((await client.get(f"{url}/metrics")).text, name, **labels)


async def await_condition(predicate, *, interval: float = 0.05) -> None:
    """Polls an async predicate (a server in another process has no event to wait on);
    the caller bounds it with ``trio.fail_after``."""
    while True:
        if await predicate():
            return
        await trio.sleep(interval)
