"""Runs workloads through vLLM's ``LLM.generate``, inside vLLM's own environment.

``python vllm_runner.py JOB.json RESULT.json``, started by ``vllm_peer.py`` with the Python
of the environment vLLM was installed into. It imports vLLM and the standard library only,
never triode: the two environments share nothing. The job names the checkpoint, the engine
options, and each workload's token-id prompts and output lengths; the result holds the
start-up time and, per workload, the seconds ``generate`` took and the tokens it produced.
"""

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as job_file:
        job = json.load(job_file)
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], seed=0, **job["engine"])
    result = {"startup_seconds": time.perf_counter() - started, "workloads": {}}
    for workload in job["workloads"]:
        prompts = [{"prompt_token_ids": prompt} for prompt in workload["prompts"]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - started
        tokens = [list(output.outputs[0].token_ids) for output in outputs]
        result["workloads"][workload["name"]] = {
            "seconds": seconds,
            "output_tokens": sum(map(len, tokens)),
            "tokens_per_second": sum(map(len, tokens)) / seconds,
            "token_ids": tokens,
        }
    with open(result_path, "w") as result_file:
        json.dump(result, result_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
