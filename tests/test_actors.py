"""Actor tests: the real engine actors (intake, scheduler, output, supervisor) around an
in-process fake worker group, on trio's mock clock (autojump): cancellation, slow
consumers, overload, watchdog restarts and the restart budget."""

from __future__ import annotations

import json
import shutil
import threading

import attrs
import pytest
import trio
import trio.testing

from tests.fake_workers import FakeWorkerGroup, fake_token
from triode.engine.async_llm import AsyncLLM
from triode.engine.chat_options import ChatOptions
from triode.engine.config import EngineArgs
from triode.engine.errors import (
    EngineDeadError,
    EngineShutdownError,
    InvalidRequestError,
    QueueFull,
)
from triode.engine.sampling_params import OutputKind, SamplingParams
from triode.engine.worker_messages import StepPlan


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **options)


def open_engine(model_dir, group: FakeWorkerGroup, **args):
    engine_args = EngineArgs(model=str(model_dir), **{"step_timeout": 5.0, **args})
    return AsyncLLM.open(engine_args, open_group=group.open)


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, **options):
    final = None
    async for output in llm.generate(prompt, params, **options):
        final = output
    return final


def expected_tokens(seq_id: str, prompt_len: int, count: int) -> tuple[int, ...]:
    return tuple(fake_token(seq_id, prompt_len + i) for i in range(count))


async def test_requests_complete_and_free_their_blocks(model_dir, autojump_clock):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group) as llm:
        results = {}

        async def run(i: int) -> None:
            results[i] = await collect(llm, [5, 6, 7, 8 + i], greedy(10), request_id=f"r{i}")

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(run, i)
        for i, output in results.items():
            assert output.finished
            assert output.outputs[0].token_ids == expected_tokens(f"r{i}", 4, 10)
            assert output.outputs[0].finish_reason == "length"
        stats = llm.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_cancelled_consumer_frees_blocks_before_next_step(model_dir, autojump_clock, async_scheduling):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group, async_scheduling=async_scheduling) as llm:
        other_done = trio.Event()

        async def other() -> None:
            await collect(llm, [1, 2, 3], greedy(40), request_id="other")
            other_done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            with trio.CancelScope() as scope:
                async for _ in llm.generate([9] * 40, greedy(100), request_id="victim"):
                    scope.cancel()  # the consumer is cancelled after its first output
            # The very next plan must already tell the worker to drop the victim; with async
            # scheduling the next one was planned while the victim's step ran, so the one after.
            plan = await group.next_step()
            if async_scheduling and "victim" not in plan.finished_seq_ids:
                plan = await group.next_step()
            assert "victim" in plan.finished_seq_ids
            assert all(chunk.seq_id != "victim" for chunk in plan.chunks)
            assert llm.statistics().kv_blocks_free >= llm.statistics().kv_blocks_total - 1
            await other_done.wait()
        stats = llm.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_slow_consumer_does_not_delay_others(model_dir, autojump_clock):
    group = FakeWorkerGroup(step_seconds=0.05)
    async with open_engine(model_dir, group) as llm:
        finished_at = {}
        seen = {"slow": 0}

        async def slow() -> None:
            text_tokens = []
            async for output in llm.generate([1, 2], greedy(30, output_kind=OutputKind.DELTA), request_id="slow"):
                seen["slow"] += 1
                text_tokens.extend(output.outputs[0].token_ids if output.outputs else ())
                await trio.sleep(1.0)  # reads one output a second
            assert tuple(text_tokens) == expected_tokens("slow", 2, 30)
            finished_at["slow"] = trio.current_time()

        async def fast() -> None:
            start = trio.current_time()
            await collect(llm, [3, 4], greedy(30), request_id="fast")
            finished_at["fast"] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            nursery.start_soon(fast)
        # 30 steps of 0.05 s; the slow reader must not stretch the fast one's time.
        assert finished_at["fast"] < 30 * 0.05 + 0.5
        assert seen["slow"] < 30  # deltas were coalesced instead of queued without bound


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_each_step_is_planned_while_the_one_before_runs(model_dir, autojump_clock, async_scheduling):
    group = FakeWorkerGroup(step_seconds=0.05)
    async with open_engine(model_dir, group, async_scheduling=async_scheduling) as llm:
        params = SamplingParams(n=2, seed=1, max_tokens=6, ignore_eos=True)  # two sequences at once
        output = await collect(llm, [1, 2, 3], params, request_id="a")
        assert [c.token_ids for c in output.outputs] == [expected_tokens(f"a-{i}", 3, 6) for i in range(2)]
    # After the prefill every plan was made ahead: it feeds each sequence the token the step
    # before it sampled (filled in from that step's result, which the fake checks). None goes
    # past max_tokens, so the last step has no plan behind it.
    planned_ahead = [any(chunk.sampled_input for chunk in plan.chunks) for plan in group.plans]
    if async_scheduling:
        assert planned_ahead == [False] + [True] * 5
        assert all(sum(c.sampled_input for c in plan.chunks) == 2 for plan in group.plans[1:])
        assert len(group.fed) == 10  # fed by the worker, which the fake checks
    else:
        assert not any(planned_ahead)


async def test_reset_prefix_cache_forgets_the_cached_prompts_only_while_no_request_runs(model_dir, autojump_clock):
    group = FakeWorkerGroup(step_seconds=0.05)
    async with open_engine(model_dir, group) as llm:
        prompt = list(range(1, 41))  # two full blocks of 16 and a part
        assert (await collect(llm, prompt, greedy(2))).num_cached_tokens == 0
        assert (await collect(llm, prompt, greedy(2))).num_cached_tokens == 32
        async with trio.open_nursery() as nursery:
            running = trio.Event()

            async def long_request() -> None:
                async for _ in llm.generate([7] * 20, greedy(50)):
                    running.set()

            nursery.start_soon(long_request)
            await running.wait()
            assert await llm.reset_prefix_cache() is False  # its blocks are in use: nothing changes
        assert (await collect(llm, prompt, greedy(2))).num_cached_tokens == 32
        assert await llm.reset_prefix_cache() is True
        assert (await collect(llm, prompt, greedy(2))).num_cached_tokens == 0
        stats = llm.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_steps_outputs_are_built_while_the_next_step_runs(model_dir, autojump_clock, monkeypatch):
    group = FakeWorkerGroup(step_seconds=0.05)
    sent: list[StepPlan] = []
    submit = group.submit

    def recording_submit(plan: StepPlan):
        sent.append(plan)
        return submit(plan)

    monkeypatch.setattr(group, "submit", recording_submit)
    async with open_engine(model_dir, group, async_scheduling=False) as llm:
        plans_sent_when_built: list[int] = []
        process = llm.output.processor.process

        def recording_process(updates, now):
            plans_sent_when_built.append(len(sent))
            return process(updates, now)

        monkeypatch.setattr(llm.output.processor, "process", recording_process)
        output = await collect(llm, [1, 2, 3], greedy(6), request_id="a")
        assert output.outputs[0].token_ids == expected_tokens("a", 3, 6)
    # Step k's outputs were built once step k + 1 was sent; the last step has none behind it.
    assert len(sent) == 6
    assert plans_sent_when_built == [2, 3, 4, 5, 6, 6]


@pytest.mark.parametrize("failure", ["crash", "raise", "hang"])
async def test_steps_sent_ahead_of_a_failed_one_are_lost_with_it(model_dir, autojump_clock, failure):
    """With async scheduling the step after a failed one is already on the workers: the
    restart loses it too, once, and every sequence is recomputed from the tokens it had."""
    group = FakeWorkerGroup(step_seconds=0.05)
    async with open_engine(model_dir, group, async_scheduling=True) as llm:
        async def fail_third_step() -> None:
            for _ in range(2):
                await group.next_step()
            group.faults.append(failure)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail_third_step)
            output = await collect(llm, [1, 2, 3], greedy(8), request_id="a")
        assert output.outputs[0].token_ids == expected_tokens("a", 3, 8)
        stats = llm.statistics()
        assert stats.worker_restarts == 1 and group.loads == 2


async def test_flood_gets_queue_full_at_once(model_dir, autojump_clock):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group, max_queued_requests=2) as llm:
        outcomes = []

        async def client(i: int) -> None:
            try:
                await collect(llm, [1, 2, 3], greedy(4), request_id=f"c{i}")
                outcomes.append("ok")
            except QueueFull:
                outcomes.append("full")

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(client, i)
        assert outcomes.count("full") >= 1
        assert outcomes.count("ok") >= 2
        assert len(outcomes) == 10


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_watchdog_restarts_a_hung_worker_and_requests_finish(model_dir, autojump_clock, async_scheduling):
    group = FakeWorkerGroup()
    group.faults = [None, None, "hang"]
    async with open_engine(model_dir, group, step_timeout=3.0, async_scheduling=async_scheduling) as llm:
        output = await collect(llm, [1, 2, 3], greedy(12), request_id="r")
        assert output.outputs[0].token_ids == expected_tokens("r", 3, 12)
        stats = llm.statistics()
        assert stats.worker_restarts == 1
        assert group.loads == 2
        assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("fault", ["crash", "raise"])
async def test_failed_step_is_recomputed(model_dir, autojump_clock, fault, async_scheduling):
    group = FakeWorkerGroup()
    group.faults = [None, fault, None, fault]
    async with open_engine(model_dir, group, async_scheduling=async_scheduling) as llm:
        output = await collect(llm, [1, 2, 3], greedy(12), request_id="r")
        assert output.outputs[0].token_ids == expected_tokens("r", 3, 12)
        assert llm.statistics().worker_restarts == 2


async def test_restart_budget_exhaustion_fails_every_open_request(model_dir, autojump_clock):
    group = FakeWorkerGroup()
    group.faults = ["crash"] * 10
    async with open_engine(model_dir, group) as llm:
        errors = []

        async def client(i: int) -> None:
            try:
                await collect(llm, [1, 2, 3 + i], greedy(8), request_id=f"c{i}")
            except EngineDeadError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(client, i)
        assert len(errors) == 4
        assert "restart budget" in str(errors[0])
        with pytest.raises(EngineDeadError):
            llm.check_health()
        with pytest.raises(EngineDeadError):
            await collect(llm, [1], greedy(2))


async def test_bad_requests_fail_alone(model_dir, autojump_clock):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group) as llm:
        good = {}

        async def valid() -> None:
            good["out"] = await collect(llm, [1, 2, 3], greedy(6), request_id="good")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(valid)
            with pytest.raises(InvalidRequestError, match="prompt"):
                await collect(llm, "", greedy(4))
            with pytest.raises(InvalidRequestError, match="vocabulary"):
                await collect(llm, [1, 10**6], greedy(4))
            with pytest.raises(InvalidRequestError, match="request_id: expected a string, got int"):
                await collect(llm, [1, 2], greedy(4), request_id=123)
            with pytest.raises(InvalidRequestError, match="priority: expected an integer, got str"):
                await collect(llm, [1, 2], greedy(4), priority="high")
            with pytest.raises(InvalidRequestError, match="prompt"):
                await collect(llm, [1] * 300, greedy(4))
            # A lone surrogate (JSON's "\\ud800") is not valid Unicode: the tokenizer raised
            # TypeError on it, which ended the engine.
            with pytest.raises(InvalidRequestError, match=r"prompt: the text holds a lone surrogate "
                                                          r"\('\\ud800'\) at character 3"):
                await collect(llm, "abc\ud800", greedy(4))
            with pytest.raises(InvalidRequestError, match="messages: the text holds a lone surrogate") as error:
                await collect(llm, ChatOptions(messages=[{"role": "user", "content": "\udc80"}],
                                               chat_template="{{ messages[0].content }}"), greedy(4))
            assert error.value.field == "messages"
        assert good["out"].outputs[0].token_ids == expected_tokens("good", 3, 6)


async def test_a_text_too_long_to_fit_is_refused_before_it_is_tokenized(model_dir, autojump_clock, monkeypatch):
    """More characters than max_model_len of the vocabulary's longest tokens could spell: the
    intake refuses it without tokenizing (megabytes took seconds, while the requests behind it
    waited). With truncate_prompt_tokens it is tokenized and cut."""
    async with open_engine(model_dir, FakeWorkerGroup()) as llm:
        processor = llm.intake.processor
        longest = max(map(len, llm.tokenizer.get_vocab()))
        text = "fox " * (llm.max_model_len * longest // 4 + 1)
        encoded = []
        encode = processor.encode
        monkeypatch.setattr(processor, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
        with pytest.raises(InvalidRequestError, match=f"prompt: {len(text)} characters are more than the model's "
                                                      f"maximum length of {llm.max_model_len} tokens") as error:
            await collect(llm, text, greedy(2))
        assert error.value.field == "prompt" and encoded == []
        with pytest.raises(InvalidRequestError, match=r"messages: .* characters are more than"):
            await collect(llm, ChatOptions(messages=[{"role": "user", "content": text}],
                                           chat_template="{{ messages[0].content }}"), greedy(2))
        cut = await collect(llm, text, greedy(2, truncate_prompt_tokens=8))
        assert len(cut.prompt_token_ids) == 8 and encoded == [len(text)]


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(model_dir, autojump_clock):
    """vLLM's truncate_prompt_tokens: the last k tokens (-1: all but the one place a token of
    output needs), after which max_tokens is bounded by what is left; more than the model's
    length is refused."""
    async with open_engine(model_dir, FakeWorkerGroup()) as llm:
        limit = llm.max_model_len
        output = await collect(llm, list(range(1, 11)), greedy(5, truncate_prompt_tokens=4), request_id="cut")
        assert output.prompt_token_ids == (7, 8, 9, 10)
        assert output.outputs[0].token_ids == expected_tokens("cut", 4, 5)
        long = await collect(llm, [3] * (limit + 40), SamplingParams(
            temperature=0.0, max_tokens=None, ignore_eos=True, truncate_prompt_tokens=limit - 4), request_id="long")
        assert len(long.prompt_token_ids) == limit - 4 and len(long.outputs[0].token_ids) == 4
        with pytest.raises(InvalidRequestError, match=f"truncate_prompt_tokens: {limit + 1} exceeds") as error:
            await collect(llm, [3] * 10, greedy(2, truncate_prompt_tokens=limit + 1))
        assert error.value.field == "truncate_prompt_tokens"
        whole = await collect(llm, [3] * (limit + 40), greedy(2, truncate_prompt_tokens=-1), request_id="whole")
        assert len(whole.prompt_token_ids) == limit - 1 and len(whole.outputs[0].token_ids) == 1
        with pytest.raises(InvalidRequestError, match="no room for output"):
            await collect(llm, [3] * (limit + 40), greedy(2, truncate_prompt_tokens=limit))
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens: expected -1 or a positive integer"):
        greedy(2, truncate_prompt_tokens=0)


async def test_a_fault_in_processing_one_request_fails_it_alone(model_dir, autojump_clock, monkeypatch):
    """An exception the intake did not expect (a bug, not bad input, which raises
    InvalidRequestError) fails its request with that exception; the engine serves on."""
    async with open_engine(model_dir, FakeWorkerGroup()) as llm:
        process = llm.intake.processor.process

        def faulty(prompt, params, lora_request=None):
            if prompt == [9, 9, 9]:
                raise TypeError("a fault in processing")
            return process(prompt, params, lora_request)

        monkeypatch.setattr(llm.intake.processor, "process", faulty)
        with pytest.raises(TypeError, match="a fault in processing"):
            await collect(llm, [9, 9, 9], greedy(4))
        output = await collect(llm, [1, 2, 3], greedy(6), request_id="after")
        assert output.outputs[0].token_ids == expected_tokens("after", 3, 6)
        assert llm.intake.statistics().rejected == 1


async def test_an_actor_that_raises_fails_every_open_request(model_dir, autojump_clock, monkeypatch):
    """Consumers outside the engine's nursery (the server's request handlers) are not
    cancelled with it: when an actor raises, each open request fails with EngineDeadError
    naming the fault, instead of waiting for ever, and the engine reports itself dead."""
    ready, opened = trio.Event(), {}
    errors: list[EngineDeadError] = []

    async def engine() -> None:
        try:
            async with open_engine(model_dir, FakeWorkerGroup()) as llm:
                opened["llm"] = llm
                complete_step, steps = llm.scheduler.core.complete_step, []

                def failing_on_the_third(*args):
                    steps.append(None)
                    if len(steps) == 3:
                        raise RuntimeError("a fault in the scheduler")
                    return complete_step(*args)

                monkeypatch.setattr(llm.scheduler.core, "complete_step", failing_on_the_third)
                ready.set()
                await trio.sleep_forever()
        except* RuntimeError:
            pass

    async def client(i: int) -> None:
        await ready.wait()
        try:
            await collect(opened["llm"], [1, 2, 3 + i], greedy(20), request_id=f"c{i}")
        except EngineDeadError as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        for i in range(3):
            nursery.start_soon(client, i)
    assert len(errors) == 3
    assert all("the engine failed: RuntimeError: a fault in the scheduler" == str(e) for e in errors)
    with pytest.raises(EngineDeadError, match="a fault in the scheduler"):
        opened["llm"].check_health()


@pytest.fixture
def eos_model_dir(model_dir, tmp_path):
    """The tiny model with end-of-sequence ids the fake worker emits: 39 in config.json and
    46 in generation_config.json only, with a sampling default there too."""
    copy = tmp_path / "eos-model"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": [39]}))
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 46, "temperature": 0.25}))
    return copy


async def test_every_end_of_sequence_id_stops_a_request(eos_model_dir, autojump_clock):
    # Request "r" after a 3-token prompt emits 32, 39, 46, 53, ... (fake_token).
    assert expected_tokens("r", 3, 4) == (32, 39, 46, 53)
    async with open_engine(eos_model_dir, FakeWorkerGroup()) as llm:
        assert llm.generation.eos_token_ids == (0, 39, 46)  # the tokenizer's own first
        stop = SamplingParams(temperature=0.0, max_tokens=10)
        by_config = await collect(llm, [5, 6, 7], stop, request_id="r")
        assert by_config.outputs[0].token_ids == (32, 39)
        assert (by_config.outputs[0].finish_reason, by_config.outputs[0].stop_reason) == ("stop", 39)
        later = await collect(llm, [5, 6, 7], attrs.evolve(stop, min_tokens=3), request_id="r")
        assert later.outputs[0].token_ids == (32, 39, 46)
        assert (later.outputs[0].finish_reason, later.outputs[0].stop_reason) == ("stop", 46)
        ignored = await collect(llm, [5, 6, 7], attrs.evolve(stop, ignore_eos=True, max_tokens=4),
                                request_id="r")
        assert ignored.outputs[0].finish_reason == "length"
        assert llm.get_default_sampling_params().temperature == 0.25
        assert llm.statistics().kv_blocks_free == llm.statistics().kv_blocks_total


async def test_generation_config_vllm_keeps_eos_ids_and_drops_sampling_defaults(eos_model_dir, autojump_clock):
    async with open_engine(eos_model_dir, FakeWorkerGroup(), generation_config="vllm") as llm:
        assert llm.generation.eos_token_ids == (0, 39, 46)
        assert llm.get_default_sampling_params().temperature == 1.0


async def test_a_colliding_sample_id_rejects_the_request_whole(model_dir, autojump_clock):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group) as llm:
        results = {}

        async def holder() -> None:
            results["x-1"] = await collect(llm, [1, 2, 3], greedy(20), request_id="x-1")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await group.next_step()
            with pytest.raises(InvalidRequestError, match="sample 1 of 'x'") as error:
                await collect(llm, [4, 5, 6], greedy(4, n=2), request_id="x")
            assert error.value.field == "request_id"
            stats = llm.statistics()
            assert stats.num_running + stats.num_waiting == 1  # x-0 was never admitted
        assert results["x-1"].outputs[0].token_ids == expected_tokens("x-1", 3, 20)
        assert all(not s.seq_id.startswith("x-0") for p in group.plans for s in p.new_sequences)


async def test_abort_before_the_request_reaches_the_scheduler_still_ends_it(
    model_dir, autojump_clock, monkeypatch
):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group) as llm:
        # Text prompts are tokenized in a thread: hold it there until the abort was sent.
        release = threading.Event()
        process = llm.intake.processor.process
        monkeypatch.setattr(llm.intake.processor, "process",
                            lambda *args: release.wait(10) and process(*args))
        finals = []

        async def consume() -> None:
            async for output in llm.generate("held in intake", greedy(50), "early"):
                finals.append(output)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            await llm.abort("early")
            release.set()
        assert [o.outputs[0].finish_reason for o in finals] == ["abort"]
        assert not any(c.seq_id == "early" for p in group.plans for c in p.chunks)
        stats = llm.statistics()
        assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_an_aborted_final_only_request_ends_with_every_token_it_sampled(
    model_dir, autojump_clock, async_scheduling
):
    # Its sequence reports its tokens at its end (Sequence.reports_at_end): the abort hands
    # the output side those it had not seen.
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group, async_scheduling=async_scheduling) as llm:
        finals = []

        async def consume() -> None:
            params = greedy(500, output_kind=OutputKind.FINAL_ONLY)
            async for output in llm.generate([1, 2, 3], params, "final"):
                finals.append(output)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.sleep(1.0)  # about 20 steps of the fake workers
            await llm.abort("final")
        assert len(finals) == 1
        (completion,) = finals[0].outputs
        assert completion.finish_reason == "abort"
        assert len(completion.token_ids) > 5
        assert completion.token_ids == expected_tokens("final", 3, len(completion.token_ids))


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_stop_strings_end_the_sequence_in_the_scheduler(model_dir, autojump_clock, async_scheduling):
    group = FakeWorkerGroup()
    async with open_engine(model_dir, group, async_scheduling=async_scheduling) as llm:
        tokenizer = llm.tokenizer
        # The text of the fake's fourth token (after a 3-token prompt) as the stop string.
        stop = tokenizer.decode([expected_tokens("s", 3, 4)[3]])
        params = greedy(30, stop=[stop], include_stop_str_in_output=True)
        output = await collect(llm, [1, 2, 3], params, request_id="s")
        assert output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == stop
        # The scheduler ended it at once (a step may have been in flight, and with async
        # scheduling one more planned behind it), and the worker forgets it with the next plan.
        assert sum(1 for p in group.plans for c in p.chunks if c.seq_id == "s") <= 5 + async_scheduling
        assert llm.statistics().kv_blocks_free == llm.statistics().kv_blocks_total
        await collect(llm, [4, 5], greedy(1), request_id="next")
        assert "s" in group.plans[-1].finished_seq_ids


async def test_bad_chat_options_fail_naming_the_field(model_dir, autojump_clock):
    async with open_engine(model_dir, FakeWorkerGroup()) as llm:
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(InvalidRequestError) as error:
            await collect(llm, ChatOptions(messages=messages, chat_template="{% for %}"), greedy(2))
        assert error.value.field == "chat_template"
        with pytest.raises(InvalidRequestError) as error:
            ChatOptions(messages=messages, chat_template_kwargs=[("a", 1)])
        assert error.value.field == "chat_template_kwargs"
        with pytest.raises(InvalidRequestError) as error:
            await collect(llm, {"prompt": "x", "images": []}, greedy(2))
        assert error.value.field == "prompt" and "'images'" in str(error.value)
        rendered = await collect(llm, ChatOptions(messages=messages, chat_template="{{ messages[0].content }}!"),
                                 greedy(2))
        assert rendered.prompt == "hi!"
        assert llm.statistics().num_waiting == 0


async def test_chat_content_given_as_text_parts_is_joined(model_dir, autojump_clock):
    """OpenAI's array of text parts, as vLLM's LLM.chat takes it (it failed to render); another
    kind of part is refused naming it."""
    async with open_engine(model_dir, FakeWorkerGroup()) as llm:
        template = "{{ messages[0].content }}"
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
        output = await collect(llm, ChatOptions(messages=[{"role": "user", "content": parts}],
                                                chat_template=template), greedy(2))
        assert output.prompt == "hi\nthere"
        image = [*parts, {"type": "image_url", "image_url": {"url": "x"}}]
        with pytest.raises(InvalidRequestError, match=r"only text parts are supported \(got type 'image_url'\)") as error:
            await collect(llm, ChatOptions(messages=[{"role": "user", "content": image}], chat_template=template),
                          greedy(2))
        assert error.value.field == "messages[0].content[2]"


@pytest.mark.parametrize("block_raises", [False, True])
async def test_closing_the_engine_ends_requests_consumed_outside_it(model_dir, autojump_clock, block_raises):
    """A consumer outside ``AsyncLLM.open``'s block is not cancelled with it: when the block
    ends, normally or by its own exception (which is not the engine failing), the request
    fails with EngineShutdownError instead of waiting for ever."""
    ready, opened, errors = trio.Event(), {}, []

    async def engine() -> None:
        try:
            async with open_engine(model_dir, FakeWorkerGroup()) as llm:
                opened["llm"] = llm
                ready.set()
                await trio.sleep(1.0)  # mock time: the request is mid-way
                if block_raises:
                    raise ValueError("the caller's own fault")
        except* ValueError:
            assert block_raises

    async def client() -> None:
        await ready.wait()
        try:
            await collect(opened["llm"], [1, 2, 3], greedy(10_000), request_id="long")
        except (EngineShutdownError, EngineDeadError) as error:
            errors.append(error)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        nursery.start_soon(client)
    assert len(errors) == 1
    assert type(errors[0]) is EngineShutdownError and "closed while the request was open" in str(errors[0])
