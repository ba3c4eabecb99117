"""contract: the step channel between the engine (actors/step_channel.py) and a worker's step
server (worker/step_server.py), over a real Unix socket, the server's blocking loop in a
thread with a stand-in for the model: plans sent ahead are answered in order, a step that
raises is reported and the loop goes on, a stranger without the token is turned away, and
either side closing ends the other cleanly."""

from __future__ import annotations

import socket

import pytest
import trio

from triode.engine.actors.step_channel import (
    StepChannel,
    StepRaised,
    accept_worker,
    new_token,
    open_listener,
)
from triode.engine.worker import step_server
from triode.engine.worker_messages import SampledTokens, ScheduledChunk, StepPlan, StepResult


def _plan(step_id: int) -> StepPlan:
    return StepPlan(step_id=step_id, chunks=(ScheduledChunk("a", (step_id,), step_id),))


def _execute(plan: StepPlan) -> StepResult:
    if plan.step_id == 2:
        raise KeyError("no such sequence")
    return StepResult(step_id=plan.step_id, sampled=SampledTokens(("a",), (100 + plan.step_id,)))


async def _serve_in_thread(address: str, token: bytes, done: list) -> None:
    await trio.to_thread.run_sync(step_server.serve, address, token, _execute)
    done.append(True)


async def test_plans_sent_ahead_come_back_in_order_and_a_raising_step_is_reported():
    served: list = []
    with trio.fail_after(10):
        async with open_listener() as (address, listener), trio.open_nursery() as nursery:
            token = new_token()
            nursery.start_soon(_serve_in_thread, address, token, served)
            stream = await accept_worker(listener, token)
            channel = StepChannel(stream)
            nursery.start_soon(channel.run)
            pendings = [channel.send(_plan(i)) for i in range(4)]  # all out before any reply
            for pending in pendings:
                await pending.done.wait()
            assert [p.result.step_id for p in pendings if p.result] == [0, 1, 3]
            assert isinstance(pendings[2].error, StepRaised) and pendings[2].error.remote_type == "KeyError"
            assert pendings[3].result.sampled.token_ids == (103,)
            channel.close()  # the worker's loop ends, and with it the call
    assert served == [True]


async def test_a_connection_without_the_token_is_turned_away():
    with trio.fail_after(10):
        async with open_listener() as (address, listener), trio.open_nursery() as nursery:
            token = new_token()

            def stranger_connects() -> socket.socket:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(address)
                sock.sendall(b"x" * len(token))
                return sock

            stranger = await trio.to_thread.run_sync(stranger_connects)  # first in the queue
            with stranger:
                nursery.start_soon(_serve_in_thread, address, token, [])
                channel = StepChannel(await accept_worker(listener, token))
                assert await trio.to_thread.run_sync(stranger.recv, 1) == b""  # closed on it
            nursery.start_soon(channel.run)
            pending = channel.send(_plan(7))
            await pending.done.wait()
            assert pending.result.step_id == 7
            channel.close()


async def test_a_worker_that_goes_away_fails_what_waits_and_what_comes_after():
    with trio.fail_after(10):
        async with open_listener() as (address, listener), trio.open_nursery() as nursery:
            token = new_token()

            def dies_after_the_token() -> None:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(address)
                    sock.sendall(token)
                    sock.recv(1)  # the first plan's first byte, then gone

            nursery.start_soon(trio.to_thread.run_sync, dies_after_the_token)
            channel = StepChannel(await accept_worker(listener, token))
            pending = channel.send(_plan(0))
            await channel.run()  # returns when the worker's end closes
            assert not pending.done.is_set()
            channel.fail_pending(ConnectionError("rank 0's worker process died"))
            assert isinstance(pending.error, ConnectionError)
            later = channel.send(_plan(1))
            assert later.done.is_set() and isinstance(later.error, ConnectionError)


def test_more_plans_out_than_a_driver_keeps_is_a_bug():
    async def main() -> None:
        left, right = socket.socketpair()
        with left, right:
            channel = StepChannel(trio.SocketStream(trio.socket.from_stdlib_socket(left)))
            with pytest.raises(RuntimeError, match="more than 4 plans out"):
                for step in range(5):
                    channel.send(_plan(step))

    trio.run(main)
