"""Unit tests: the fault plan, the test facility that makes workers crash, hang or raise at
given steps. It is read from TRIODE_FAULT_PLAN in the engine's environment, never from an
engine argument or a serve flag."""

from __future__ import annotations

import pytest

from triode import EngineArgs
from triode.engine.errors import InvalidRequestError
from triode.engine.worker.faults import Fault, fault_plan_from_env, parse_fault_plan
from triode.frontend import cli


def test_the_plan_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("TRIODE_FAULT_PLAN", raising=False)
    assert fault_plan_from_env() is None
    monkeypatch.setenv("TRIODE_FAULT_PLAN", "hang@5,crash@30..60")
    assert fault_plan_from_env() == "hang@5,crash@30..60"
    assert parse_fault_plan(fault_plan_from_env()) == (Fault("hang", 5, 5), Fault("crash", 30, 60))


@pytest.mark.parametrize("plan", ["crash", "explode@3", "crash@9..2", "crash@-1", "crash@x"])
def test_a_malformed_plan_is_refused_naming_the_variable(monkeypatch, plan):
    monkeypatch.setenv("TRIODE_FAULT_PLAN", plan)
    with pytest.raises(InvalidRequestError, match=r"TRIODE_FAULT_PLAN: .* is not KIND@STEP"):
        fault_plan_from_env()


def test_it_is_no_engine_argument():
    with pytest.raises(TypeError):
        EngineArgs(fault_plan="crash@3")  # type: ignore[call-arg]


def test_serve_refuses_the_old_flag_naming_where_it_belongs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--fault-plan", "crash@3"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--fault-plan is not a serving option" in error and "TRIODE_FAULT_PLAN" in error
