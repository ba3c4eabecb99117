"""Unit tests (trio, autojump_clock): how the server starts a completion with several prompts
(``routes.generation.start``), on a fake engine."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from triode.engine.errors import InvalidRequestError
from triode.engine.sampling_params import SamplingParams
from triode.frontend.openai.errors import APIError
from triode.frontend.openai.request_body import StreamOptions
from triode.frontend.openai.requests import GenerationRequest
from triode.frontend.routes import generation


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


class _Engine:
    """generate(): "bad" fails validation at once, any other prompt's first output is a
    minute away (a long prefill step runs); records which streams were closed."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def require_ready(self) -> _Engine:
        return self

    async def generate(self, prompt, params, request_id, *, priority, lora_request):
        try:
            if prompt == "bad":
                raise InvalidRequestError("prompt: token id 99999 is outside the vocabulary", field="prompt")
            await trio.sleep(60)
            yield "first output"
        finally:
            self.closed.append(request_id)


async def test_the_first_invalid_prompt_answers_at_once_and_aborts_the_others(autojump_clock):
    engine = _Engine()
    request = GenerationRequest(model=None, params=SamplingParams(), priority=0,
                                stream=StreamOptions(stream=False, include_usage=False),
                                prompts=("fine", "bad", "also fine"))
    with pytest.raises(APIError) as caught:
        await generation.start(engine, request, "cmpl-1")  # type: ignore[arg-type]
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert trio.current_time() < 1  # not the minute the valid prompts' first outputs were away
    assert sorted(engine.closed) == ["cmpl-1-0", "cmpl-1-1", "cmpl-1-2"]
