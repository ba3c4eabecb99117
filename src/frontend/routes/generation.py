"""Running one HTTP generation request as one or more engine requests.

A completion with several prompts makes one engine request per prompt; all are submitted
together, and the response starts only once each has produced its first output, so every
validation error (prompt too long, queue full...) is still an HTTP status, not a stream error.
The first such error answers at once: the other prompts' waits end and their requests are
aborted (a valid prompt's first token could be a whole prefill step away).
Outputs are then read prompt after prompt: the engine runs them all at once, and each
request's stream joins the deltas that wait, so nothing is lost by reading them in turn. No
task outlives the handler or the body generator, and closing them aborts what is left."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import attrs
import trio

from triode.engine.errors import TriodeError
from triode.engine.lora.request import LoRARequest
from triode.engine.outputs import RequestOutput
from triode.frontend.openai.errors import APIError, from_engine_error
from triode.frontend.openai.requests import GenerationRequest
from triode.frontend.server.lifecycle import EngineHost


@attrs.define
class Job:
    index: int  # the prompt's position in the request
    outputs: AsyncIterator[RequestOutput]
    first: RequestOutput | None = None
    error: Exception | None = None


def engine_request_ids(base: str, count: int) -> list[str]:
    return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]


async def start(host: EngineHost, request: GenerationRequest, base_id: str, *,
                lora: LoRARequest | None = None) -> list[Job]:
    """Submits the engine requests (with the LoRA adapter ``lora``, if any) and waits for the
    first output of each."""
    llm = host.require_ready()
    ids = engine_request_ids(base_id, request.num_requests)
    if request.chat is not None:
        jobs = [Job(0, llm.generate(request.chat, request.params, ids[0], priority=request.priority,
                                    lora_request=lora))]
    else:
        jobs = [Job(i, llm.generate(prompt, request.params, ids[i], priority=request.priority, lora_request=lora))
                for i, prompt in enumerate(request.prompts)]
    try:
        if len(jobs) == 1:
            await _first(jobs[0])
        else:
            async with trio.open_nursery() as nursery:
                for job in jobs:
                    nursery.start_soon(_first, job, nursery.cancel_scope)
        for job in jobs:
            if job.error is not None:
                # the engine's request_id is the client's X-Request-Id header
                raise from_engine_error(job.error, {"request_id": "X-Request-Id", **request.param_names})
    except BaseException:
        await close(jobs)
        raise
    return jobs


async def _first(job: Job, on_error: trio.CancelScope | None = None) -> None:
    """``on_error``: cancelled when this job fails, ending its siblings' waits."""
    try:
        job.first = await anext(aiter(job.outputs), None)
    except (TriodeError, APIError) as e:
        job.error = e
        if on_error is not None:
            on_error.cancel()
    if job.first is None and job.error is None:
        job.error = APIError(500, "the engine ended a request without output", code="internal_error")


async def close(jobs: list[Job]) -> None:
    """Aborts whatever has not finished (safe under cancellation)."""
    with trio.CancelScope(shield=True):
        for job in jobs:
            await job.outputs.aclose()


async def outputs(jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every output of every job, job after job; closing it closes the jobs."""
    try:
        for job in jobs:
            assert job.first is not None
            yield job.index, job.first
            if job.first.finished:
                continue
            async for output in job.outputs:
                yield job.index, output
    finally:
        await close(jobs)


async def finals(jobs: list[Job]) -> list[tuple[int, RequestOutput]]:
    """The final output of every job (non-streamed responses use FINAL_ONLY outputs)."""
    last: dict[int, RequestOutput] = {}
    stream = outputs(jobs)
    try:
        async for index, output in stream:
            last[index] = output
    finally:
        await stream.aclose()
    return sorted(last.items())


class EventBuilder(Protocol):
    """An API whose stream opens with events of its own (Responses, Messages)."""

    def start(self, first: RequestOutput) -> list[dict[str, Any]]: ...

    def events(self, output: RequestOutput) -> list[dict[str, Any]]: ...


async def events(jobs: list[Job], builder: EventBuilder) -> AsyncGenerator[dict[str, Any], None]:
    """The stream's events: the builder's opening ones at the first output, then those of
    every output; closing it closes the jobs."""
    stream = outputs(jobs)
    try:
        started = False
        async for _, output in stream:
            if not started:
                started = True
                for event in builder.start(output):
                    yield event
            for event in builder.events(output):
                yield event
    finally:
        await stream.aclose()
