"""Contract tests: KV-cache events as vLLM publishes them. A ZMQ subscriber that decodes the
stream with msgpack (as vllm-router's kv_aware policy and llm-d's indexer do) rebuilds the
set of cached block hashes, and it equals the engine's prefix cache: after random workloads
with evictions and worker restarts in the sans-IO core, and after a real engine's mixed
workload with a worker killed mid-run. A subscriber that missed batches gets them from the
replay socket; bad configurations fail naming the field or the address."""

from __future__ import annotations

import random
import socket
import time

import msgpack
import pytest
import zmq

from tests.http_server import free_port, wait_until
from tests.test_core_scheduler import FakeWorker, make_request, make_scheduler
from triode import EngineArgs
from triode.engine.core.kv_blocks import BlockManager
from triode.engine.core.kv_cache_events import BlockStored
from triode.engine.core.scheduler import Scheduler
from triode.engine.errors import InvalidRequestError
from triode.engine.kv_events.config import KVEventsConfig
from triode.engine.kv_events.publisher import (
    KVEventsBindError,
    encode_batch,
    external_hash,
    open_kv_event_publisher,
)

BLOCK_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                "lora_name"]


class CacheMirror:
    """What a router knows: the cached block hashes, from the events alone."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.tokens: dict[int, list[int]] = {}
        self.last_seq = -1

    def apply_batch(self, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        for event in events:
            self.apply(event)

    def apply(self, event: dict) -> None:
        match event["type"]:
            case "BlockStored":
                assert list(event) == BLOCK_FIELDS  # nothing a strict decoder would refuse
                assert event["medium"] == "GPU" and event["lora_id"] is None
                size, hashes = event["block_size"], event["block_hashes"]
                assert len(event["token_ids"]) == size * len(hashes) and len(hashes) >= 1
                parent = event["parent_block_hash"]
                assert parent is None or parent in self.hashes or parent in self.tokens
                for i, block_hash in enumerate(hashes):
                    self.hashes.add(block_hash)
                    self.tokens[block_hash] = event["token_ids"][i * size:(i + 1) * size]
            case "BlockRemoved":
                assert list(event) == ["type", "block_hashes", "medium"]
                for block_hash in event["block_hashes"]:
                    assert block_hash in self.hashes, "removed a block never stored"
                    self.hashes.discard(block_hash)
            case "AllBlocksCleared":
                assert list(event) == ["type"]
                self.hashes.clear()
            case other:
                raise AssertionError(f"unknown event {other!r}")


def engine_hashes(manager: BlockManager) -> set[int]:
    return {external_hash(h) for h in manager.cached}


# ---- the sans-IO core -------------------------------------------------------------------------


def _recording_scheduler(num_blocks: int, block_size: int, window: int | None = None) -> Scheduler:
    scheduler = make_scheduler(num_blocks, block_size, max_num_seqs=6, budget=24, sliding_window=window)
    scheduler.block_manager = BlockManager(num_blocks, block_size, True, sliding_window=window, record_events=True)
    return scheduler


@pytest.mark.parametrize("window", [None, 6])  # 6: blocks behind a sliding window are released
@pytest.mark.parametrize("seed", range(6))
def test_the_events_rebuild_the_prefix_cache_through_evictions_and_restarts(seed, window):
    rng = random.Random(seed)
    num_blocks, block_size = 24, 4
    scheduler = _recording_scheduler(num_blocks, block_size, window)
    worker = FakeWorker(num_blocks, block_size, seed, window=window)
    mirror = CacheMirror()
    bases = [[rng.randrange(1, 4) for _ in range(20)] for _ in range(3)]
    kinds = {"stored": 0, "removed": 0, "cleared": 0}
    for i in range(60):
        if rng.random() < 0.6:
            prompt = [*bases[rng.randrange(3)][:rng.randrange(5, 20)], rng.randrange(1, 9)]
            scheduler.add_sequence(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 8)))
        if not scheduler.has_unfinished_requests():
            continue
        plan = scheduler.schedule()
        if rng.random() < 0.05:
            worker.restart()
            scheduler.requeue_all_running()  # the step is lost with the worker
        elif plan.chunks:
            scheduler.update_from_output(worker.run(plan))
        events = scheduler.block_manager.take_events()
        for event in events:
            kind = type(event).__name__
            kinds["stored" if kind == "BlockStored" else "removed" if kind == "BlockRemoved" else "cleared"] += 1
        mirror.apply_batch(encode_batch(events, time.time()))
        assert mirror.hashes == engine_hashes(scheduler.block_manager)
    assert kinds["stored"] > 0 and kinds["removed"] > 0


def test_a_run_of_new_blocks_is_one_event_chained_to_its_parent():
    scheduler = _recording_scheduler(16, 4)
    worker = FakeWorker(16, 4)
    scheduler.add_sequence(make_request("a", list(range(1, 14)), max_tokens=1))
    scheduler.update_from_output(worker.run(scheduler.schedule()))
    (stored,) = scheduler.block_manager.take_events()
    assert isinstance(stored, BlockStored)
    assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None
    assert stored.token_ids == tuple(range(1, 13)) and stored.block_size == 4
    # A second conversation on the same prefix adds only its own blocks, after the shared one.
    scheduler.add_sequence(make_request("b", [1, 2, 3, 4, 9, 9, 9, 9, 9], max_tokens=1))
    scheduler.update_from_output(worker.run(scheduler.schedule()))
    (stored_b,) = scheduler.block_manager.take_events()
    assert stored_b.parent_block_hash == stored.block_hashes[0]
    assert stored_b.token_ids == (9, 9, 9, 9)


def test_no_events_are_kept_unless_asked():
    manager = BlockManager(8, 4, True)
    assert manager.take_events() == []


# ---- the publisher --------------------------------------------------------------------------


def _config(**fields) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, **fields)


def test_batches_go_out_in_vllms_frames_and_a_gap_is_filled_from_the_replay_socket():
    port, replay_port = free_port(), free_port()
    config = _config(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv")
    stored = BlockStored((b"\x01" * 16,), None, (1, 2, 3, 4), 4)
    context = zmq.Context()
    with open_kv_event_publisher(config) as publisher, context.socket(zmq.SUB) as sub, \
            context.socket(zmq.DEALER) as replay:
        for _ in range(3):  # sent before the subscriber came: its gap
            publisher.publish([stored])
        wait_until(lambda: publisher.published >= 3, timeout=5, interval=0.01, what="3 batches sent")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(f"tcp://127.0.0.1:{port}")
        # PUB drops what it sends before the subscription reaches it: publish until one arrives.
        first = None
        for _ in range(200):
            publisher.publish([stored])
            try:
                first = sub.recv_multipart(zmq.NOBLOCK)
                break
            except zmq.Again:
                time.sleep(0.02)
        assert first is not None, "no batch reached the subscriber"
        topic, seq, payload = first
        assert topic == b"kv" and len(seq) == 8
        ts, events, rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and rank == 0
        assert events == [{"type": "BlockStored", "block_hashes": [external_hash(b"\x01" * 16)],
                           "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 4,
                           "lora_id": None, "medium": "GPU", "lora_name": None}]
        received = int.from_bytes(seq, "big")
        assert received >= 3  # the ones before it never reached it
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.setsockopt(zmq.RCVTIMEO, 5000)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = replay.recv_multipart()
            assert frames[0] == b"" and frames[1] == b"kv"
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[3] == b""
                break
            replayed.append(int.from_bytes(frames[2], "big"))
        assert len(replayed) >= received + 1
        assert replayed[:received + 1] == list(range(received + 1))
        assert publisher.dropped == 0
    context.term()


def test_the_replay_buffer_keeps_the_last_buffer_steps_batches():
    replay_port = free_port()
    config = _config(endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{replay_port}", buffer_steps=3)
    context = zmq.Context()
    with open_kv_event_publisher(config) as publisher, context.socket(zmq.REQ) as replay:
        for _ in range(5):
            publisher.publish([BlockStored((b"\x02" * 16,), None, (1,), 1)])
        wait_until(lambda: publisher.published >= 5, timeout=5, interval=0.01, what="5 batches sent")
        assert publisher.published == 5
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.setsockopt(zmq.RCVTIMEO, 5000)
        replay.send((0).to_bytes(8, "big"))
        topic, seq, payload = replay.recv_multipart()  # a REQ socket reads the first reply
        assert topic == b"" and int.from_bytes(seq, "big") == 2 and payload
    context.term()


def test_a_subscriber_that_never_reads_never_blocks_the_publisher():
    port, replay_port = free_port(), free_port()
    config = _config(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", hwm=2,
                     max_queue_size=4, buffer_steps=100_000)
    payload = [BlockStored((b"\x03" * 16,), None, tuple(range(64)), 64)]
    context = zmq.Context()
    with open_kv_event_publisher(config) as publisher, context.socket(zmq.SUB) as stalled:
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.2)
        started = time.monotonic()
        for _ in range(5000):
            publisher.publish(payload)
        assert time.monotonic() - started < 5.0  # never waited on the stalled subscriber
        wait_until(lambda: publisher.published + publisher.dropped >= 5000, timeout=10, interval=0.01,
                   what="every batch sent or dropped")
        assert publisher.published + publisher.dropped == 5000
        assert publisher.published >= 1
    context.term()


def test_an_endpoint_that_cannot_be_bound_fails_naming_it():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        with pytest.raises(KVEventsBindError, match=f"tcp://\\*:{port}"):
            with open_kv_event_publisher(_config(endpoint=f"tcp://*:{port}")):
                pass


@pytest.mark.parametrize(("value", "message"), [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of null, zmq"),
    ('{"enable_kv_cache_events": true, "buffer": 3}', "unknown field.* buffer"),
    ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm must be a positive integer"),
    ('{"endpoint": "localhost"}', "endpoint must be a ZMQ address"),
    ("[1]", "must be a JSON object"),
    ("{oops", "not JSON"),
])
def test_a_bad_config_is_refused_naming_the_field(value, message):
    with pytest.raises(InvalidRequestError, match=f"kv_events_config: {message}"):
        EngineArgs(kv_events_config=value)


def test_null_or_disabled_publishes_nothing():
    for config in (KVEventsConfig(), _config(publisher="null"), None):
        with open_kv_event_publisher(config) as publisher:
            assert publisher is None


# ---- a real engine --------------------------------------------------------------------------


def _collect(sub: zmq.Socket, live: dict[int, bytes], until: float) -> None:
    while time.monotonic() < until:
        try:
            _, seq, payload = sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        live[int.from_bytes(seq, "big")] = payload


def _replayed(context: zmq.Context, port: int) -> dict[int, bytes]:
    with context.socket(zmq.DEALER) as replay:
        replay.connect(f"tcp://127.0.0.1:{port}")
        replay.setsockopt(zmq.RCVTIMEO, 5000)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = {}
        while (frames := replay.recv_multipart())[2] != (-1).to_bytes(8, "big", signed=True):
            batches[int.from_bytes(frames[2], "big")] = frames[3]
        return batches


def test_a_real_engines_events_match_its_cache_after_evictions_and_a_worker_restart(
        tiny_model_factory, monkeypatch):
    from triode import LLMEngine, SamplingParams

    model = tiny_model_factory("llama")
    port, replay_port = free_port(), free_port()
    monkeypatch.setenv("TRIODE_FAULT_PLAN", "crash@9")
    args = EngineArgs(model=str(model), kv_cache_memory="96KiB", block_size=4, max_model_len=128,
                      kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                                        "replay_endpoint": f"tcp://*:{replay_port}"})
    context = zmq.Context()
    live: dict[int, bytes] = {}
    with context.socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        engine = LLMEngine(args)
        try:
            manager = engine.core.scheduler.block_manager
            rng = random.Random(0)
            shared = [rng.randrange(5, 200) for _ in range(24)]
            for i in range(24):  # conversations on a shared prefix, and unrelated ones
                prompt = shared[:rng.randrange(8, 24)] if i % 2 else [rng.randrange(5, 200) for _ in range(20)]
                engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                                   SamplingParams(max_tokens=rng.randrange(4, 16), ignore_eos=True))
                if i % 4 == 3:
                    while engine.has_unfinished_requests():
                        engine.step()
                        _collect(sub, live, time.monotonic() + 1)
            while engine.has_unfinished_requests():
                engine.step()
            stats = engine.statistics()
            assert stats.worker_restarts == 1
            expected = engine_hashes(manager)
            _collect(sub, live, time.monotonic() + 1)  # what arrived live: a subset of the replay
            replayed = _replayed(context, replay_port)
        finally:
            engine.close()
    context.term()
    assert len(replayed) >= 10 and sorted(replayed) == list(range(len(replayed)))
    assert all(replayed[seq] == payload for seq, payload in live.items())  # the same stream
    mirror = CacheMirror()
    kinds = set()
    for seq in sorted(replayed):
        mirror.apply_batch(replayed[seq])
        kinds.update(event["type"] for event in msgpack.unpackb(replayed[seq])[1])
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert mirror.hashes == expected and expected
