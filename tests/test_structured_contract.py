"""Contract tests: structured outputs through the real engine (worker process, the default
model). Constrained requests run alone, then all at once on a KV cache too small for them
(preemption by recompute), then again with the worker SIGKILLed mid-output: the greedy
outputs are identical each time, and every one is valid against its constraint. A long
prompt is prefilled in chunks, and the later runs find the prompts in the prefix cache."""

from __future__ import annotations

import json
import os
import re
import signal

import jsonschema
import pytest

from triode import LLM, SamplingParams, StructuredOutputsParams
from triode.engine.errors import InvalidRequestError

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ANSWERS = ["yes", "no", "it depends"]
BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4  # one 16-token block of the default model in float32


def requests() -> list[tuple[str, SamplingParams]]:
    def params(**constraint) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=90,
                              structured_outputs=StructuredOutputsParams(**constraint))

    def chat(text: str) -> str:
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    people = [f"Describe a person from {town} as JSON." for town in ("Paris", "Rome", "Oslo", "Bergen")]
    return [
        *((chat(p), params(json=PERSON)) for p in people),
        ("Call me at", params(regex=PHONE)),
        # Longer than a step's 64-token budget: its prefill is chunked before it samples.
        ("My number changed again last week, so please note the new one. " * 6 + "Call me at",
         params(regex=PHONE)),
        ("Is the sky blue? Answer:", params(choice=ANSWERS)),
        (chat("Give me a JSON object with the keys a and b."),
         params(json_object=True, disable_any_whitespace=True)),
        ("A list of fruit:", params(grammar='start: "[" fruit ("," fruit)? ("," fruit)? "]"\nfruit: "apple" | "pear"')),
    ]


def check_valid(params: SamplingParams, text: str) -> None:
    constraint = params.structured_outputs
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict) and " " not in text and "\n" not in text
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice
    else:
        assert re.fullmatch(r"\[(apple|pear)(,(apple|pear)){0,2}\]", text), text


@pytest.fixture(scope="module")
def llm():
    # 13 blocks hold two or three of these sequences at a time, not eight.
    with LLM(kv_cache_memory=13 * BLOCK_BYTES, max_model_len=192, max_num_batched_tokens=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def alone(llm):
    outputs = []
    for prompt, params in requests():
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        outputs.append(output.outputs[0])
    return outputs


def test_each_constraint_holds_and_ends_with_stop(alone):
    for (_, params), output in zip(requests(), alone, strict=True):
        assert output.finish_reason == "stop", output
        check_valid(params, output.text)


def test_preempted_constrained_requests_end_as_they_do_alone(llm, alone):
    before = llm.llm_engine.statistics().num_preemptions
    prompts, params = zip(*requests(), strict=True)
    outputs = llm.generate(list(prompts), list(params), use_tqdm=False)
    assert llm.llm_engine.statistics().num_preemptions > before
    assert [o.outputs[0].token_ids for o in outputs] == [o.token_ids for o in alone]


def test_a_worker_killed_mid_output_changes_nothing(llm, alone):
    engine = llm.llm_engine
    restarts = engine.statistics().worker_restarts
    for index, (prompt, params) in enumerate(requests()):
        engine.add_request(f"kill-{index}", prompt, params)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 12:  # every sequence is partway into its grammar
            (pid,) = engine.statistics().worker_pids
            os.kill(pid, signal.SIGKILL)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        steps += 1
    assert engine.statistics().worker_restarts == restarts + 1
    assert [finished[f"kill-{i}"] for i in range(len(alone))] == [o.token_ids for o in alone]


def test_sampled_constraints_hold_with_n_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=90, logprobs=2,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    (output,) = llm.chat([{"role": "user", "content": "A person as JSON, please."}], params,
                         use_tqdm=False)
    for completion in output.outputs:
        check_valid(params, completion.text)
        for token_id, logprobs in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token_id in logprobs  # the chosen token is among the allowed ones


def test_a_constrained_output_cut_by_max_tokens_says_length(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"json": PERSON})
    (output,) = llm.generate(["JSON:"], params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 5


def test_a_bad_constraint_is_refused_before_scheduling(llm):
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.json: ") as caught:
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "objekt"}}), use_tqdm=False)
    assert caught.value.field == "structured_outputs.json"
    assert not llm.llm_engine.has_unfinished_requests()
