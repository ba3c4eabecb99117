"""Script tests: Python code run the way people run it, each in its own interpreter, through
``tests/script_runner.py`` (which fails a run that leaves a process behind): every
```python block of README.md as a file and on stdin (a client example against a served default
model), a ``python -c`` one-liner, a script
with a main guard and a module run with ``-m`` without one, scripts in vLLM's documented
idiom with only the import changed, and an interrupted ``generate``.

The scripts start together, a few at a time, when the module's first test asks for one:
each spends most of its life starting an interpreter and a worker."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.http_server import running, triode_serve

pytestmark = [pytest.mark.contract, pytest.mark.default_model]

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "script_runner.py"
TIMEOUT_S = 600  # the first run on a fresh machine also downloads and converts the model
CONCURRENT = 3


README_SERVER = "http://127.0.0.1:8000"  # where README's client examples find `make serve`


def _readme_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def readme_python_blocks() -> list[str]:
    """README's examples that run on their own."""
    return [block for block in _readme_blocks() if README_SERVER not in block]


def readme_client_blocks() -> list[str]:
    """README's examples that talk to the server `make serve` starts."""
    return [block for block in _readme_blocks() if README_SERVER in block]


VLLM_QUICKSTART = """\
from triode import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model=MODEL)
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
print("generated", len(outputs))
"""

VLLM_LOGPROBS = """\
from triode import LLM, SamplingParams

llm = LLM(model=MODEL, max_model_len=256)
tokenizer = llm.get_tokenizer()
params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2)
prompts = [{"prompt": "The quick brown fox"},
           {"prompt_token_ids": tokenizer.encode("Paris is the capital of")}]
for output in llm.generate(prompts, sampling_params=params, use_tqdm=False):
    completion = output.outputs[0]
    total = 0.0
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
        chosen = logprobs[token_id]
        assert chosen.rank == 1 and chosen.logprob <= 0.0, chosen  # greedy: the likeliest
        assert chosen.decoded_token == tokenizer.decode([token_id])
        assert len(logprobs) == 3 and sorted(lp.rank for lp in logprobs.values()) == [1, 2, 3]
        total += chosen.logprob
    assert abs(total - completion.cumulative_logprob) < 1e-4
    assert output.prompt_logprobs[0] is None
    for token_id, logprobs in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert token_id in logprobs and len(logprobs) in (2, 3)
    print("logprobs ok", repr(completion.text))
"""

VLLM_CHAT = """\
from triode import LLM, SamplingParams

llm = LLM(model=MODEL)
sampling_params = SamplingParams(temperature=0.5, max_tokens=16)


def print_outputs(outputs):
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")


conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
print_outputs(outputs)

conversations = [conversation for _ in range(4)]
outputs = llm.chat(conversations, sampling_params=sampling_params, use_tqdm=True)
print_outputs(outputs)

chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}assistant:"
outputs = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=chat_template)
assert outputs[0].prompt.endswith("assistant:"), outputs[0].prompt
outputs = llm.chat(conversation, sampling_params, use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})
print("chat ok")
"""

INTERRUPTED = """\
import gc, os, signal, threading, time
from triode import LLM, SamplingParams

llm = LLM(model=MODEL, max_model_len=512)
greedy = SamplingParams(temperature=0.0, max_tokens=8)
reference = llm.generate(["Paris is the capital of"], greedy, use_tqdm=False)[0].outputs[0].token_ids


def interrupt_after_a_few_steps():
    start = llm.llm_engine.statistics().steps
    while llm.llm_engine.statistics().steps < start + 5:
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGINT)


threading.Thread(target=interrupt_after_a_few_steps, daemon=True).start()
try:
    llm.generate(["The quick brown fox"] * 32, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    raise SystemExit("generate was not interrupted")
except KeyboardInterrupt:
    pass
engine = llm.llm_engine
assert not engine.has_unfinished_requests()
again = llm.generate(["Paris is the capital of"], greedy, use_tqdm=False)[0].outputs[0].token_ids
assert again == reference, (again, reference)
stats = engine.statistics()
assert stats.kv_blocks_free == stats.kv_blocks_total, stats

dropped = LLM(model=MODEL, max_model_len=512)
(pid,) = dropped.llm_engine.statistics().worker_pids
del dropped
gc.collect()
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.05)
else:
    raise SystemExit(f"the collected LLM's worker {pid} still runs")
print("interrupted ok")  # and exits with `llm` still open
"""

MAIN_GUARD = """\
from triode import LLM, SamplingParams


def main():
    with LLM(model=MODEL) as llm:
        print(llm.generate("Paris is", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].text)
    print("guarded ok")


if __name__ == "__main__":
    main()
"""

MODULE_WITHOUT_GUARD = """\
from triode import LLM, SamplingParams

llm = LLM(model=MODEL)
print(llm.generate(["Paris is"], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].text)
print("module ok")
"""


def _with_model(source: str, model: Path) -> str:
    return f"MODEL = {str(model)!r}\n" + source


def _scripts(tiny: Path) -> dict[str, tuple[list[str], str | None, dict[str, str]]]:
    """name -> (arguments after python, stdin text, files to write into the working dir)."""
    scripts: dict[str, tuple[list[str], str | None, dict[str, str]]] = {}
    for index, block in enumerate(readme_python_blocks()):
        scripts[f"readme-{index}-file"] = (["example.py"], None, {"example.py": block})
        scripts[f"readme-{index}-stdin"] = (["-"], block, {})
    one_liner = (f"from triode import LLM, SamplingParams; llm = LLM({str(tiny)!r}); "
                 "print(llm.generate('Paris is', SamplingParams(max_tokens=4))[0].outputs[0].text); "
                 "print('one-liner ok')")
    scripts["python-c"] = (["-c", one_liner], None, {})
    scripts["main-guard"] = (["guarded.py"], None, {"guarded.py": _with_model(MAIN_GUARD, tiny)})
    scripts["python-m"] = (["-m", "unguarded"], None,
                           {"unguarded.py": _with_model(MODULE_WITHOUT_GUARD, tiny)})
    for name, source in [("vllm-quickstart", VLLM_QUICKSTART), ("vllm-logprobs", VLLM_LOGPROBS),
                         ("vllm-chat", VLLM_CHAT), ("interrupted", INTERRUPTED)]:
        scripts[name] = ([f"{name}.py"], None, {f"{name}.py": _with_model(source, tiny)})
    return scripts


EXPECTED_OUTPUT = {
    "readme-0-file": "Paris", "readme-0-stdin": "Paris",
    "python-c": "one-liner ok", "main-guard": "guarded ok", "python-m": "module ok",
    "vllm-quickstart": "generated 4", "vllm-logprobs": "logprobs ok", "vllm-chat": "chat ok",
    "interrupted": "interrupted ok",
}
NAMES = sorted(set(EXPECTED_OUTPUT) | {f"readme-{i}-{how}" for i in range(len(readme_python_blocks()))
                                       for how in ("file", "stdin")})


def _run(directory: Path, args: list[str], stdin: str | None, files: dict[str, str]):
    directory.mkdir()
    for name, text in files.items():
        (directory / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, str(RUNNER), sys.executable, *args], input=stdin, cwd=directory,
        capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )


@pytest.fixture(scope="module")
def runs(tiny_model_factory, tmp_path_factory):
    tiny = tiny_model_factory("llama")
    base = tmp_path_factory.mktemp("scripts")
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        futures = {name: pool.submit(_run, base / name, *spec) for name, spec in _scripts(tiny).items()}
        yield futures
        for future in futures.values():
            future.cancel()


def test_readme_has_python_examples():
    assert len(readme_python_blocks()) >= 2
    assert len(readme_client_blocks()) >= 1


def test_readme_client_examples_run_against_the_server(tmp_path):
    """Against the default model served as `make serve` serves it (on another port here)."""
    blocks = readme_client_blocks()
    assert len(blocks) == 1
    with running(triode_serve(None)) as server:
        for index, block in enumerate(blocks):
            result = _run(tmp_path / f"client-{index}", ["client.py"], None,
                          {"client.py": block.replace(README_SERVER, server.url)})
            report = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
            assert result.returncode == 0 and "Paris" in result.stdout, report


@pytest.mark.parametrize("name", NAMES)
def test_script_runs_as_people_run_it(runs, name):
    result = runs[name].result()
    report = f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, report
    assert "ORPHANS" not in result.stderr and "Traceback" not in result.stderr, report
    assert EXPECTED_OUTPUT.get(name, "") in result.stdout, report
