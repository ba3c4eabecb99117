"""`triode scenario run PATH`: plays a scenario file or a folder of them against real servers,
prints one row per scenario, writes JSON, exits non-zero when any expectation fails."""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection
from pathlib import Path

import attrs
import trio

from triode.scenarios.judge import Verdict
from triode.scenarios.runner import ScenarioRunner
from triode.scenarios.server import ServerExited
from triode.scenarios.spec import ScenarioError, load_scenarios

_COLUMNS = ("scenario", "verdict", "requests", "lost", "mismatched", "recovery s", "p99 s", "load s", "wall s")


def _row(verdict: Verdict) -> list[str]:
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return [verdict.name, "PASS" if verdict.passed else "FAIL", str(verdict.requests), str(verdict.lost),
            str(verdict.mismatched), num(verdict.recovery_seconds), num(verdict.p99_seconds),
            num(verdict.load_seconds), num(verdict.wall_seconds)]


async def run_all(target: Path, *, model: str | None, only: Collection[str] | None = None,
                  batch_invariant: bool = True) -> list[Verdict]:
    """Plays the scenario files at ``target`` (those named in ``only``, if given) in order. Where
    the first two scenarios' servers both exit before they become healthy (a model that does
    not load fails every start the same way), the rest are not played: the run ends with those
    two failures rather than minutes of the same one."""
    scenarios = [s for s in load_scenarios(target) if only is None or s.name in only]
    runner = ScenarioRunner(model=model, batch_invariant=batch_invariant)
    widths = [max(len(c), 12) for c in _COLUMNS]
    widths[0] = max(widths[0], *(len(s.name) for s in scenarios))
    print("  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True)), flush=True)
    verdicts: list[Verdict] = []
    started, exits = False, 0  # whether a server has started; the exits at start before one did
    try:
        for scenario in scenarios:
            if not started and exits == _EXITS_BEFORE_GIVING_UP:
                print(f"    the servers of the first {exits} scenarios exited at start: the other "
                      f"{len(scenarios) - len(verdicts)} were not played", flush=True)
                break
            try:
                verdict = await runner.run(scenario)
                started = True
            except RuntimeError as e:  # the server could not be started or misbehaved outright
                verdict = Verdict(name=scenario.name)
                verdict.fail(str(e))
                exits += isinstance(e, ServerExited)
            verdicts.append(verdict)
            print("  ".join(c.ljust(w) for c, w in zip(_row(verdict), widths, strict=True)), flush=True)
            for failure in verdict.failures:
                print(f"    - {failure}", flush=True)
            if verdict.server_log:
                print("    server log:\n" + "\n".join(f"      {line}" for line in verdict.server_log.splitlines()),
                      flush=True)
    finally:
        await runner.close()
    return verdicts


_EXITS_BEFORE_GIVING_UP = 2


def write_json(output: Path, verdicts: list[Verdict]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps([attrs.asdict(v) for v in verdicts], indent=2))
    print(f"wrote {output}")


def _run(namespace: argparse.Namespace) -> int:
    try:
        verdicts = trio.run(lambda: run_all(Path(namespace.path), model=namespace.model,
                                            batch_invariant=namespace.batch_invariant))
    except ScenarioError as e:
        print(f"triode scenario: {e}")
        return 2
    write_json(Path(namespace.json), verdicts)
    failed = [v.name for v in verdicts if not v.passed]
    print(f"{len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def add_scenario_commands(commands: argparse._SubParsersAction) -> None:
    scenario = commands.add_parser("scenario", help="fault-injection scenarios against a real server")
    actions = scenario.add_subparsers(dest="action", required=True)
    run = actions.add_parser("run", help="play a scenario file or a folder of them")
    run.add_argument("path", help="a .toml scenario or a folder of them")
    run.add_argument("--model", default=None, help="model for the servers (default: the default model)")
    run.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                     help="start the servers without --batch-invariant (where the device has no invariant "
                          "kernels; a recomputed greedy output may then differ at a near tie)")
    run.add_argument("--json", default="bench-results/scenarios.json", help="where to write the results")
    run.set_defaults(handler=_run)
