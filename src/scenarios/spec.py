"""The scenario format (TOML): a workload, the faults injected while it runs, and what must
hold. Parsed into frozen attrs classes; a malformed file fails with its path and the field."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs

from triode.field_types import first_type_problem

EXTERNAL_FAULTS = ("sigkill_worker", "sigterm_server", "disconnect", "slow_reader", "malformed")
SERVER_FAULTS = ("sigkill_worker", "sigterm_server")
ENGINE_FAULTS = {"worker_crash": "crash", "worker_hang": "hang", "worker_raise": "raise"}


class ScenarioError(ValueError):
    """A scenario file that cannot be played; the message names the file and the field."""


@attrs.frozen(kw_only=True)
class Workload:
    api: str = "completions"  # or "chat"
    stream: bool = True
    concurrency: int = 8  # clients sending one request after another
    requests: int = 8
    arrival_rate: float = 0.0  # > 0: open-loop Poisson arrivals instead of fixed concurrency
    prompt_tokens: tuple[int, int] = (32, 64)  # synthetic prompts: token count range
    prompts: tuple[str, ...] = ()  # or literal prompts, used in turn
    max_tokens: tuple[int, int] = (16, 16)
    temperature: float = 0.0
    seed: int = 0
    # > 0: the servers serve this many random LoRA adapters of rank lora_rank (written for the
    # model's shape) and requests take turns: adapter 0, 1, ..., then the base model
    lora_adapters: int = 0
    lora_rank: int = 8


@attrs.frozen(kw_only=True)
class Fault:
    kind: str
    at: float = 0.0  # seconds after the workload starts, or after ``after_tokens`` (external faults)
    # External faults: wait until the clients have received this many streamed tokens in
    # all, so the fault lands mid-stream however fast or loaded the machine is.
    after_tokens: int | None = None
    at_step: int = 0  # engine step (engine faults)
    until_step: int | None = None  # engine faults: every step up to this one
    clients: int = 0  # disconnect / slow_reader: how many requests behave so
    after_chunks: int = 1  # disconnect: leave after a random 1..after_chunks chunks (seeded)
    chunk_interval: float = 1.0  # slow_reader: seconds between reads
    count: int = 0  # malformed: requests in the burst


@attrs.frozen(kw_only=True)
class Expect:
    finish_reasons: tuple[str, ...] = ("length", "stop")
    errors: tuple[str, ...] = ()  # substrings of error messages that accepted requests may end with
    match_reference: bool = True  # greedy outputs identical to an undisturbed run
    kv_free_at_end: bool = True
    health_within: float | None = None  # seconds after the last fault until /health is 200
    health_within_load_plus: float | None = None  # same bound, as the server's load time + this
    health_at_end: int = 200
    statuses: tuple[int, ...] = ()  # non-200 statuses that are acceptable (4xx for malformed input)
    max_p99_ratio: float | None = None  # p99 latency relative to the undisturbed run
    min_preemptions: int = 0
    min_worker_restarts: int = 0  # proves an injected worker fault really happened
    server_exit_code: int | None = None  # for scenarios that stop the server
    max_rss_growth_mb: float | None = None  # server process memory growth over the run


@attrs.frozen(kw_only=True)
class Scenario:
    name: str
    description: str
    path: Path
    server_args: tuple[str, ...]
    reference_args: tuple[str, ...]  # the undisturbed run's server (default: server_args)
    workload: Workload
    faults: tuple[Fault, ...]
    expect: Expect

    @property
    def fault_plan(self) -> str | None:
        items = []
        for fault in self.faults:
            if fault.kind in ENGINE_FAULTS:
                last = fault.until_step if fault.until_step is not None else fault.at_step
                items.append(f"{ENGINE_FAULTS[fault.kind]}@{fault.at_step}..{last}")
        return ",".join(items) or None

    def faults_of(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind]

    @property
    def disturbs_server(self) -> bool:
        """Whether a fault acts on the server itself (its workers or its process), rather
        than only through what clients send and read. Only such a scenario needs a server
        of its own; the others can share the undisturbed reference server."""
        return any(f.kind in ENGINE_FAULTS or f.kind in SERVER_FAULTS for f in self.faults)


_SECTIONS = ("name", "description", "server", "workload", "fault", "expect")
MAX_REQUESTS = 100_000


def _build(cls: type, raw: Any, path: Path, section: str):
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: [{section}] must be a table, got {type(raw).__name__}")
    names = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ScenarioError(f"{path}: [{section}] has unknown fields {unknown}; known: {sorted(names)}")
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    try:
        built = cls(**converted)
    except (TypeError, ValueError) as e:
        raise ScenarioError(f"{path}: [{section}]: {e}") from None
    if problem := first_type_problem(built):  # a field of the wrong type fails here, not mid-play
        raise ScenarioError(f"{path}: [{section}]: {problem[1]}")
    return built


def _check_workload(workload: Workload, path: Path) -> None:
    if workload.api not in ("completions", "chat"):
        raise ScenarioError(f"{path}: [workload] api must be 'completions' or 'chat'")
    # Nothing sent would pass every check: a scenario must play at least one request.
    if workload.requests < 1 or (workload.concurrency < 1 and workload.arrival_rate <= 0):
        raise ScenarioError(f"{path}: [workload] needs requests >= 1 and concurrency >= 1 (or arrival_rate > 0)")
    if workload.requests > MAX_REQUESTS:  # every request is built before the scenario plays
        raise ScenarioError(f"{path}: [workload] requests = {workload.requests} is more than {MAX_REQUESTS}")
    for name in ("prompt_tokens", "max_tokens"):
        low, high = getattr(workload, name)
        if not 1 <= low <= high:
            raise ScenarioError(f"{path}: [workload] {name} must be [low, high] with 1 <= low <= high")


def _check_fault(fault: Fault, path: Path) -> None:
    """Counts and times a fault cannot take (each once failed mid-play, or marked the wrong
    requests: clients = -1 took all but the last)."""
    for name in ("at", "at_step", "clients", "count", "after_tokens"):
        if (getattr(fault, name) or 0) < 0:
            raise ScenarioError(f"{path}: [[fault]] {fault.kind}: {name} must not be negative")
    if fault.after_chunks < 1 or fault.chunk_interval < 0:
        raise ScenarioError(f"{path}: [[fault]] {fault.kind}: after_chunks must be at least 1 and "
                            f"chunk_interval not negative")
    if fault.until_step is not None and fault.until_step < fault.at_step:
        raise ScenarioError(f"{path}: [[fault]] {fault.kind}: until_step ({fault.until_step}) comes before "
                            f"at_step ({fault.at_step})")


def _arguments(server: dict[str, Any], name: str, path: Path) -> tuple[str, ...] | None:
    value = server.get(name)
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ScenarioError(f"{path}: [server] {name} must be a list of strings (one per argument)")
    return None if value is None else tuple(value)


def load_scenario(path: Path) -> Scenario:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ScenarioError(f"{path}: {e}") from None
    if "name" not in raw:
        raise ScenarioError(f"{path}: a scenario needs a name")
    if unknown := sorted(set(raw) - set(_SECTIONS)):
        raise ScenarioError(f"{path}: unknown top-level keys {unknown}; known: {', '.join(_SECTIONS)} "
                            f"(faults are [[fault]] tables)")
    if not isinstance(raw.get("fault", []), list):
        raise ScenarioError(f"{path}: fault must be [[fault]] tables")
    faults = tuple(_build(Fault, f, path, "fault") for f in raw.get("fault", []))
    for fault in faults:
        if fault.kind not in EXTERNAL_FAULTS and fault.kind not in ENGINE_FAULTS:
            known = ", ".join((*EXTERNAL_FAULTS, *ENGINE_FAULTS))
            raise ScenarioError(f"{path}: fault kind {fault.kind!r} is not one of {known}")
        _check_fault(fault, path)
    server = raw.get("server", {})
    if not isinstance(server, dict):
        raise ScenarioError(f"{path}: [server] must be a table")
    unknown = sorted(set(server) - {"args", "reference_args"})
    if unknown:
        raise ScenarioError(f"{path}: [server] has unknown fields {unknown}; known: args, reference_args")
    args = _arguments(server, "args", path) or ()
    reference_args = _arguments(server, "reference_args", path)
    workload = _build(Workload, raw.get("workload", {}), path, "workload")
    _check_workload(workload, path)
    if not isinstance(raw["name"], str) or not isinstance(raw.get("description", ""), str):
        raise ScenarioError(f"{path}: name and description must be strings")
    return Scenario(
        name=raw["name"],
        description=raw.get("description", ""),
        path=path,
        server_args=args,
        reference_args=args if reference_args is None else reference_args,
        workload=workload,
        faults=faults,
        expect=_build(Expect, raw.get("expect", {}), path, "expect"),
    )


def load_scenarios(target: Path) -> list[Scenario]:
    files = sorted(target.glob("*.toml")) if target.is_dir() else [target]
    if not files:
        raise ScenarioError(f"{target}: no scenario files (*.toml)")
    return [load_scenario(path) for path in files]
