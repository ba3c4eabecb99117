"""Scenario tests: the files in scenarios/ played through the same runner as
`triode scenario run`, against real `triode serve` processes on the default model."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import trio

from triode.scenarios.client import Progress
from triode.scenarios.command import run_all
from triode.scenarios.runner import reference_key
from triode.scenarios.spec import ScenarioError, load_scenario, load_scenarios

pytestmark = [pytest.mark.default_model]

SCENARIOS = Path(__file__).parent.parent / "scenarios"


# Clients that leave a stream early (the disconnect faults, and every stream after [DONE])
# leave httpx2's chained byte iterators unexhausted; trio warns when it finalizes them.
# Every fault kind at least once, and preemption under a crash: the files `make test` plays
# (about half the time of all fourteen). The rest are marked slow: make test-all and make
# test-scenarios play every file.
QUICK = ("worker-hang-watchdog", "worker-exception", "slow-readers", "malformed-burst", "restart-storm",
         "crash-with-disconnects", "preemption-during-crash", "sigterm-during-restart", "lora-sigkill")
_ASYNC_GENERATOR_WARNING = r"ignore:Async generator '(httpx2|httpcore2)\.[\w.]+' was garbage collected"


async def _assert_scenarios_hold(only=None):
    # One runner for all files, as `triode scenario run scenarios/` plays them: scenarios with
    # the same reference arguments share one undisturbed reference server.
    verdicts = await run_all(SCENARIOS, model=None, only=only)
    failures = [f"{v.name}: {failure}" for v in verdicts for failure in v.failures]
    assert not failures, "\n".join(failures)
    return verdicts


@pytest.mark.scenarios
@pytest.mark.filterwarnings(_ASYNC_GENERATOR_WARNING)
async def test_a_scenario_of_every_fault_kind_holds():
    verdicts = await _assert_scenarios_hold(QUICK)
    assert sorted(v.name for v in verdicts) == sorted(QUICK)


@pytest.mark.slow
@pytest.mark.scenarios
@pytest.mark.filterwarnings(_ASYNC_GENERATOR_WARNING)
async def test_every_scenario_holds():
    verdicts = await _assert_scenarios_hold()
    assert len(verdicts) == len(list(SCENARIOS.glob("*.toml")))


def test_there_are_enough_scenarios_covering_every_fault():
    scenarios = load_scenarios(SCENARIOS)
    assert len(scenarios) >= 12
    kinds = {fault.kind for s in scenarios for fault in s.faults}
    assert kinds >= {"sigkill_worker", "sigterm_server", "disconnect", "slow_reader", "malformed",
                     "worker_crash", "worker_hang", "worker_raise"}
    assert any(s.expect.min_preemptions for s in scenarios)
    quick = [s for s in scenarios if s.name in QUICK]
    assert {fault.kind for s in quick for fault in s.faults} == kinds
    assert any(s.expect.min_preemptions for s in quick)


def test_malformed_scenario_files_are_rejected_with_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[workload]\nclients = 3\n')
    with pytest.raises(ScenarioError, match=r"bad.toml.*\[workload\].*clients"):
        load_scenario(bad)
    bad.write_text('name = "x"\n[[fault]]\nkind = "meteor"\n')
    with pytest.raises(ScenarioError, match="meteor"):
        load_scenario(bad)


@pytest.mark.parametrize(("text", "says"), [
    # each was a traceback, a scenario that passed without running, or arguments split per character
    ('[workload]\nrequests = "lots"', r"\[workload\]: requests: expected an integer"),
    ("[workload]\nprompt_tokens = [8]", r"prompt_tokens: expected a pair of integers"),
    ("[workload]\nmax_tokens = [10, 2]", r"max_tokens must be \[low, high\]"),
    ("[workload]\nrequests = -3", r"needs requests >= 1"),
    ("[workload]\nconcurrency = 0", r"needs requests >= 1 and concurrency >= 1"),
    ('[[fault]]\nkind = "sigkill_worker"\nat = "soon"', r"\[fault\]: at: expected a number"),
    ("fault = 5", r"fault must be \[\[fault\]\] tables"),
    ('[[faults]]\nkind = "sigkill_worker"', r"unknown top-level keys \['faults'\]"),
    ('[server]\nargs = "--max-model-len 256"', r"\[server\] args must be a list of strings"),
    ("[workload]\nrequests = 1000000000", r"requests = 1000000000 is more than 100000"),
    ('[[fault]]\nkind = "disconnect"\nclients = -1', r"disconnect: clients must not be negative"),
    ('[[fault]]\nkind = "disconnect"\nclients = 2\nafter_chunks = 0', r"after_chunks must be at least 1"),
    ('[[fault]]\nkind = "slow_reader"\nclients = 2\nchunk_interval = -1.0', r"chunk_interval not negative"),
    ('[[fault]]\nkind = "worker_raise"\nat_step = 5\nuntil_step = 2', r"until_step \(2\) comes before"),
])
def test_malformed_fields_are_refused_before_anything_plays(tmp_path, text, says):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'name = "x"\n{text}\n')
    with pytest.raises(ScenarioError, match=says):
        load_scenario(bad)


def test_a_file_that_is_not_utf8_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'name = "\xff"\n')
    with pytest.raises(ScenarioError, match=r"bad\.toml.*utf-8"):
        load_scenario(bad)


def test_only_client_side_faults_share_the_reference_server():
    by_name = {s.name: s for s in load_scenarios(SCENARIOS)}
    assert not by_name["malformed-burst"].disturbs_server
    assert not by_name["client-disconnects"].disturbs_server
    for name in ("worker-sigkill-streaming", "worker-hang-watchdog", "sigterm-drain", "restart-storm"):
        assert by_name[name].disturbs_server, name


def test_reference_runs_are_shared_only_when_outputs_must_agree():
    by_name = {s.name: s for s in load_scenarios(SCENARIOS)}
    # The same prompts and lengths, streamed by 32 clients or sent whole by 8: one reference.
    assert reference_key(by_name["baseline"], []) == reference_key(by_name["worker-exception"], [])
    # Other server flags, or a latency bound that needs its own arrival pattern: not shared.
    assert reference_key(by_name["baseline"], []) != reference_key(by_name["baseline"], ["--max-model-len", "128"])
    slow = by_name["slow-readers"]
    assert reference_key(slow, []) != reference_key(attrs.evolve(slow, expect=attrs.evolve(
        slow.expect, max_p99_ratio=None)), [])


async def test_faults_wait_for_streamed_output(autojump_clock):
    progress = Progress()
    reached = []

    async def fault(threshold: int) -> None:
        await progress.wait_for(threshold)
        reached.append((threshold, progress.chunks))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fault, 3)
        nursery.start_soon(fault, 1)
        for _ in range(4):
            await trio.sleep(1)
            progress.note()
    assert reached == [(1, 1), (3, 3)]


class _RunnerWhoseServersExit:
    """ScenarioRunner's interface; every server it starts exits before it is healthy, as with a
    model that does not load."""

    def __init__(self, *, model, batch_invariant):
        self.played: list[str] = []

    async def run(self, scenario):
        from triode.scenarios.server import ServerExited

        self.played.append(scenario.name)
        raise ServerExited("the server exited with 1:\ntriode: error: the model could not be loaded")

    async def close(self):
        pass


async def test_a_model_that_does_not_load_ends_the_run_after_two_scenarios(monkeypatch, capsys):
    """It used to play every file, each failing the same way after a server start."""
    import triode.scenarios.command

    runners = []
    monkeypatch.setattr(triode.scenarios.command, "ScenarioRunner",
                        lambda **options: runners.append(_RunnerWhoseServersExit(**options)) or runners[-1])
    verdicts = await run_all(SCENARIOS, model="/no/such/model")
    assert len(verdicts) == 2 and len(runners) == 1
    assert runners[0].played == [v.name for v in verdicts]
    assert all("could not be loaded" in v.failures[0] for v in verdicts)
    total = len(load_scenarios(SCENARIOS))
    assert f"the other {total - 2} were not played" in capsys.readouterr().out
