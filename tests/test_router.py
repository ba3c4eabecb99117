"""HTTP tests: triode replicas behind vllm-router (the PyPI binary) on 127.0.0.1. Round-robin
and cache-aware routing serve streamed and non-streamed OpenAI requests without an error and
use every replica; kv_aware, fed by the replicas' KV-cache events, sends a conversation's next
turn to the replica that holds its prefix (its prefix-cache hits say so); a replica killed
under load leaves rotation, and a restarted one returns to it. Slow: each test starts servers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest

from tests.http_server import (
    BIN,
    ServerProcess,
    free_port,
    metric,
    running,
    triode_serve,
    wait_until,
)
from triode.bench.router import running_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (BIN / "vllm-router").exists(), reason="vllm-router is installed on x86-64 Linux"),
]

MODEL = "tiny"


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama", max_position_embeddings=1024)


def replica(model: Path, *, port: int | None = None, events_port: int | None = None) -> ServerProcess:
    flags = ["--served-model-name", MODEL, "--kv-cache-memory", "32MiB"]
    if events_port is not None:
        flags += ["--kv-events-config",
                  f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events_port}"}}']
    if port is None:
        return triode_serve(model, *flags)
    # a restart on the port the router knows
    return ServerProcess([str(BIN / "triode"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                          *flags])


def router(urls: list[str], policy: str, *extra: str) -> contextlib.AbstractContextManager[str]:
    """The bench's router, with health checks every second (two failures out, one success in)."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-router-{os.getpid()}-{free_port()}.log"
    return running_router(urls, policy, log, "--health-check-interval-secs", "1", "--health-failure-threshold",
                          "2", "--health-success-threshold", "1", *extra)


@pytest.fixture(scope="module")
def replicas(model):
    with running(replica(model, events_port=(a := free_port()))) as first, \
            running(replica(model, events_port=(b := free_port()))) as second:
        yield [(first.url, a), (second.url, b)]


def served(url: str) -> float:
    return metric(url, "vllm:request_success_total")


def ask(base: str, prompt: str, *, stream: bool, max_tokens: int = 4) -> str:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                    stream=True, extra_body={"ignore_eos": True}))
            assert chunks and chunks[-1].choices[0].finish_reason == "length"
            return "".join(c.choices[0].text for c in chunks if c.choices)
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == max_tokens
        return out.choices[0].text


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_requests_through_the_router_are_served_without_an_error(replicas, policy):
    urls = [url for url, _ in replicas]
    before = [served(url) for url in urls]
    with router(urls, policy) as base:
        for i in range(12):
            ask(base, f"request {i} about something else entirely", stream=i % 2 == 0)
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            chat = client.chat.completions.create(model=MODEL, max_tokens=3,
                                                  messages=[{"role": "user", "content": "hello"}])
            assert chat.choices[0].finish_reason in ("stop", "length")
    grown = [served(url) - b for url, b in zip(urls, before, strict=True)]
    assert len(grown) == 2 and sum(grown) == 13
    if policy == "round_robin":
        assert min(grown) >= 6, grown


def test_cache_aware_keeps_a_prompt_on_one_replica(replicas):
    urls = [url for url, _ in replicas]
    with router(urls, "cache_aware") as base:
        before = [served(url) for url in urls]
        for _ in range(4):
            ask(base, "the same long question about the same long document " * 4, stream=False)
        grown = [served(url) - b for url, b in zip(urls, before, strict=True)]
    assert sorted(grown) == [0, 4], grown


def test_kv_aware_sends_a_conversations_next_turn_to_the_replica_holding_its_prefix(replicas):
    urls = [url for url, _ in replicas]
    sources = [f"--kv-event-source={url}=tcp://127.0.0.1:{port}" for url, port in replicas]
    with router(urls, "kv_aware", *sources, "--kv-event-model", MODEL, "--kv-event-block-size", "16") as base:
        followed = 0
        for conversation in range(4):
            history = f"conversation {conversation}: " + " ".join(f"word{conversation}x{i}" for i in range(60))
            served_before = [served(url) for url in urls]
            history += ask(base, history, stream=False, max_tokens=8)
            first = [served(url) - b for url, b in zip(urls, served_before, strict=True)]
            assert sorted(first) == [0, 1]
            holder = first.index(1)
            time.sleep(1.0)  # the replica's events reach the router
            hits_before = [metric(url, "vllm:prefix_cache_hits_total") for url in urls]
            ask(base, history + " and then?", stream=True, max_tokens=4)
            hits = [metric(url, "vllm:prefix_cache_hits_total") - h for url, h in zip(urls, hits_before, strict=True)]
            assert hits[holder] >= 32 and hits[1 - holder] == 0, (conversation, holder, hits)
            followed += 1
        assert followed == 4


def test_a_killed_replica_leaves_rotation_and_a_restarted_one_returns(model):
    with running(replica(model)) as steady:
        victim = replica(model)
        victim_url = victim.wait_ready()
        port = int(victim_url.rsplit(":", 1)[1])
        try:
            with router([steady.url, victim_url], "round_robin") as base:
                # Four long streams, two on each replica by round robin, when the victim dies:
                # a stream the victim had started cannot be retried elsewhere and is cut.
                outcomes: list[str] = []

                def long_stream(i: int) -> None:
                    try:
                        ask(base, f"a long answer {i}", stream=True, max_tokens=1000)
                        outcomes.append("finished")
                    except (openai.APIError, httpx2.HTTPError, AssertionError):
                        outcomes.append("cut")

                threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(4)]
                for thread in threads:
                    thread.start()
                time.sleep(0.5)
                victim.kill()  # the server and its workers, as a node loss would
                for thread in threads:
                    thread.join(120)
                print(f"\nstreams in flight when a replica was killed: {sorted(outcomes)}")
                assert len(outcomes) == 4 and outcomes.count("finished") >= 2, outcomes
                failures = 0
                for i in range(10):  # the router's health check drops it within about two seconds
                    try:
                        ask(base, f"while one is down {i}", stream=False)
                    except openai.APIError:
                        failures += 1
                    time.sleep(0.3)
                print(f"\nrequests that failed while the killed replica was in rotation: {failures} of 10")
                assert failures <= 2, failures
                for i in range(6):
                    ask(base, f"after the health check {i}", stream=i % 2 == 0)
                restarted = replica(model, port=port)
                try:
                    restarted.wait_ready()
                    before = served(restarted.url)
                    time.sleep(2.5)  # a health check marks it healthy again
                    for i in range(8):
                        ask(base, f"after the restart {i}", stream=False)
                    assert served(restarted.url) - before >= 2
                finally:
                    restarted.stop(timeout=30)
        finally:
            if victim.process.poll() is None:
                victim.kill()



def test_a_draining_replica_leaves_rotation_before_it_stops(model):
    with running(replica(model)) as steady:
        leaving = replica(model)
        leaving_url = leaving.wait_ready()
        try:
            with router([steady.url, leaving_url], "round_robin") as base:
                outcomes: list[str] = []

                def long_stream() -> None:  # keeps the draining replica busy past the health checks
                    ask(leaving_url, "a long answer", stream=True, max_tokens=1000)
                    outcomes.append("finished")

                thread = threading.Thread(target=long_stream)
                thread.start()
                time.sleep(0.3)
                leaving.process.send_signal(signal.SIGTERM)
                wait_until(lambda: httpx2.get(f"{leaving_url}/health", timeout=2).status_code == 503,
                           what="the replica to drain")
                time.sleep(2.5)  # two failed health checks take it out of rotation
                before = served(steady.url)
                for i in range(6):
                    ask(base, f"while one drains {i}", stream=i % 2 == 0)
                assert served(steady.url) - before == 6
                thread.join(120)
                assert outcomes == ["finished"]
                assert leaving.wait_exit(60) == 0
        finally:
            if leaving.process.poll() is None:
                leaving.kill()


def _doc_blocks(after: str) -> str:
    """The first ```sh block of docs/deployment.md after the line ``after``."""
    text = (Path(__file__).parents[1] / "docs" / "deployment.md").read_text()
    rest = text[text.index(after):]
    return rest.split("```sh\n", 1)[1].split("```", 1)[0]


def test_the_deployment_recipe_runs_as_documented(model):
    script = Path(__file__).parents[1] / "deploy" / "local-replicas.sh"
    assert _doc_blocks("`deploy/local-replicas.sh` starts").strip() == "deploy/local-replicas.sh /path/to/model"
    router_port, first_port, events_port = free_port(), free_port(), free_port()
    env = {**os.environ, "ROUTER_PORT": str(router_port), "FIRST_PORT": str(first_port),
           "FIRST_EVENTS_PORT": str(events_port), "TRIODE_BIN": str(BIN / "triode"),
           "ROUTER_BIN": str(BIN / "vllm-router"), "REPLICAS": "2"}
    with ServerLog(["bash", str(script), str(model), "--kv-cache-memory", "32MiB"], env) as recipe:
        wait_until(lambda: "router ready" in recipe.text(), timeout=120, interval=0.2, what="the recipe's router")
        commands = _doc_blocks("Then any OpenAI client talks to the router:").replace(
            "127.0.0.1:30000", f"127.0.0.1:{router_port}")
        lines = [c for c in commands.split("curl ")[1:]]
        assert len(lines) == 2
        plain = subprocess.run(["bash", "-c", "curl " + lines[0]], capture_output=True, text=True, timeout=60)
        assert plain.returncode == 0, plain.stderr
        assert json.loads(plain.stdout)["choices"][0]["finish_reason"] in ("stop", "length")
        streamed = subprocess.run(["bash", "-c", "curl " + lines[1]], capture_output=True, text=True, timeout=60)
        assert streamed.returncode == 0 and streamed.stdout.rstrip().endswith("data: [DONE]"), streamed.stdout
        assert "replica ready" in recipe.text()


class ServerLog:
    """A process group whose output goes to a file; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.path = Path(os.environ.get("TMPDIR", "/tmp")) / f"recipe-{os.getpid()}-{free_port()}.log"
        self._file = self.path.open("w")
        self.process = subprocess.Popen(command, stdout=self._file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def text(self) -> str:
        return self.path.read_text()

    def __enter__(self) -> ServerLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self._file.close()
