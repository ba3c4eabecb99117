"""Contract tests: how worker processes start (triode.engine.actors.worker_spawn). They fork
from multiprocessing's forkserver, which imported torch once, the restart after a SIGKILL
too; yet each sees the environment its engine had when it opened, variables set and unset
since the forkserver started included, as a spawned process would. A forkserver killed
while an engine runs leaves its workers serving, and the next worker start makes another.
``TRIODE_WORKER_MULTIPROC_METHOD=spawn`` starts them from a fresh interpreter, with the same
outputs, and an unknown method is refused naming the variable."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

import pytest

from tests.http_server import alive
from tests.process_tree import MULTIPROCESSING_HELPERS
from triode import LLM, SamplingParams
from triode.engine.errors import InvalidRequestError, ModelLoadError
from triode.engine.worker.environment import adopt

pytestmark = [pytest.mark.contract]

PROMPTS = ["Paris is", "one two three"]
OPTIONS = {"kv_cache_memory": "16MiB", "max_model_len": 256}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def command_of(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


@pytest.fixture(autouse=True)
def default_method(monkeypatch):
    monkeypatch.delenv("TRIODE_WORKER_MULTIPROC_METHOD", raising=False)


def worker_and_parent(llm: LLM) -> tuple[int, int]:
    (pid,) = llm.llm_engine.statistics().worker_pids
    return pid, parent_of(pid)


def test_workers_fork_from_the_forkserver_and_take_their_engines_environment(tiny, monkeypatch):
    with LLM(tiny, **OPTIONS) as llm:
        reference = greedy_tokens(llm)
        pid, forkserver = worker_and_parent(llm)
        assert forkserver != os.getpid() and parent_of(forkserver) == os.getpid()
        assert MULTIPROCESSING_HELPERS[0] in command_of(forkserver)
        os.kill(pid, signal.SIGKILL)
        assert greedy_tokens(llm) == reference
        stats = llm.llm_engine.statistics()
        assert stats.worker_restarts == 1
        (restarted,) = stats.worker_pids
        assert restarted != pid and parent_of(restarted) == forkserver

    # The forkserver started without this variable; the next engine's worker reads it.
    monkeypatch.setenv("TRIODE_CPU_ISA", "bogus")
    with pytest.raises(ModelLoadError, match="TRIODE_CPU_ISA must be one of"):
        LLM(tiny, **OPTIONS)
    monkeypatch.delenv("TRIODE_CPU_ISA")
    with LLM(tiny, **OPTIONS) as llm:
        assert greedy_tokens(llm) == reference
        assert worker_and_parent(llm)[1] == forkserver


def test_a_killed_forkserver_leaves_its_workers_serving_and_the_next_start_makes_another(tiny):
    with LLM(tiny, **OPTIONS) as llm:
        reference = greedy_tokens(llm)
        pid, forkserver = worker_and_parent(llm)
        os.kill(forkserver, signal.SIGKILL)
        assert greedy_tokens(llm) == reference
        assert llm.llm_engine.statistics().worker_restarts == 0
        os.kill(pid, signal.SIGKILL)
        assert greedy_tokens(llm) == reference
        stats = llm.llm_engine.statistics()
        assert stats.worker_restarts == 1
        (restarted,) = stats.worker_pids
        assert parent_of(restarted) not in (forkserver, os.getpid())
        assert MULTIPROCESSING_HELPERS[0] in command_of(parent_of(restarted))
    assert not alive(pid)  # the first worker, orphaned when its forkserver died


def test_spawned_workers_start_from_a_fresh_interpreter_with_the_same_outputs(tiny, monkeypatch):
    with LLM(tiny, **OPTIONS) as llm:
        reference = greedy_tokens(llm)
    monkeypatch.setenv("TRIODE_WORKER_MULTIPROC_METHOD", "spawn")
    with LLM(tiny, **OPTIONS) as llm:
        assert greedy_tokens(llm) == reference
        pid, parent = worker_and_parent(llm)
        assert parent == os.getpid()
        assert not any(helper in command_of(pid) for helper in MULTIPROCESSING_HELPERS)


def test_an_unknown_method_is_refused_naming_the_variable(tiny, monkeypatch):
    monkeypatch.setenv("TRIODE_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(InvalidRequestError, match=r"TRIODE_WORKER_MULTIPROC_METHOD must be one of "
                                                  r"forkserver, spawn; got 'fork'") as info:
        LLM(tiny, **OPTIONS)
    assert info.value.field == "TRIODE_WORKER_MULTIPROC_METHOD"


def test_adopting_an_environment_sets_and_unsets_variables_for_c_code_too(monkeypatch):
    monkeypatch.setenv("TRIODE_TEST_KEPT", "old")
    monkeypatch.setenv("TRIODE_TEST_GONE", "x")
    monkeypatch.delenv("TRIODE_TEST_NEW", raising=False)  # restored as absent afterwards
    wanted = {name: value for name, value in os.environ.items() if name != "TRIODE_TEST_GONE"}
    wanted |= {"TRIODE_TEST_KEPT": "new", "TRIODE_TEST_NEW": "1"}
    adopt(wanted)
    assert dict(os.environ) == wanted
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    assert [getenv(name) for name in (b"TRIODE_TEST_KEPT", b"TRIODE_TEST_NEW", b"TRIODE_TEST_GONE")] == [
        b"new", b"1", None]
