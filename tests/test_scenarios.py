"""Scenario tests: every file in scenarios/ played through the same runner as
`triode scenario run`, against real `triode serve` processes on the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.scenarios.command import run_all
from frontend.scenarios.spec import ScenarioError, load_scenario, load_scenarios

pytestmark = [pytest.mark.default_model]

SCENARIOS = Path(__file__).parent.parent / "scenarios"


@pytest.mark.scenarios
@pytest.mark.slow
async def test_every_scenario_holds():
    # One runner for all files, as `triode scenario run scenarios/` plays them: scenarios with
    # the same reference arguments share one undisturbed reference server.
    verdicts = await run_all(SCENARIOS, model=None)
    failures = [f"{v.name}: {failure}" for v in verdicts for failure in v.failures]
    assert not failures, "\n".join(failures)
    assert len(verdicts) == len(list(SCENARIOS.glob("*.toml")))


def test_there_are_enough_scenarios_covering_every_fault():
    scenarios = load_scenarios(SCENARIOS)
    assert len(scenarios) >= 12
    kinds = {fault.kind for s in scenarios for fault in s.faults}
    assert kinds >= {"sigkill_worker", "sigterm_server", "disconnect", "slow_reader", "malformed",
                     "worker_crash", "worker_hang", "worker_raise"}
    assert any(s.expect.min_preemptions for s in scenarios)


def test_malformed_scenario_files_are_rejected_with_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[workload]\nclients = 3\n')
    with pytest.raises(ScenarioError, match=r"bad.toml.*\[workload\].*clients"):
        load_scenario(bad)
    bad.write_text('name = "x"\n[[fault]]\nkind = "meteor"\n')
    with pytest.raises(ScenarioError, match="meteor"):
        load_scenario(bad)
