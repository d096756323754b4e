"""The vLLM side of ``kvstack bench memory``: run as a script by the vLLM venv's python.

Reads a job file (JSON) the driver wrote:

    {"model_dir": DIR, "prompts": [[ids...], ...], "params": [kv_transfer_params, ...],
     "warmup": N}

builds one vLLM engine (CPU, fp32, prefix caching off, ``FactConnector``), and for each prompt,
in rounds whose order alternates, times ``llm.generate`` of one token twice: the prompt
prefilled, and with the saved facts loaded by the connector (its ``params``). One token is the
time to first token: the engine step that prefills is the step that samples it. Prints one
``RESULT {json}`` line: {"prefill": [s, ...], "inject": [s, ...], "cached": [n, ...],
"first_tokens_equal": [bool, ...], "versions": {...}}.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str) -> None:
    import torch
    import vllm
    from vllm import SamplingParams

    from kvstack.vllm import fact_engine

    job = json.loads(open(job_path).read())
    llm = fact_engine(job["model_dir"])

    def first_token(ids: list[int], params: dict | None) -> tuple[float, int, int]:
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            extra_args=None if params is None else {"kv_transfer_params": params},
        )
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
        return time.perf_counter() - start, out.outputs[0].token_ids[0], out.num_cached_tokens

    jobs = list(zip(job["prompts"], job["params"], strict=True))
    for ids, params in jobs[: job["warmup"]]:  # untimed
        first_token(ids, None)
        first_token(ids, params)
    result = {"prefill": [], "inject": [], "cached": [], "first_tokens_equal": []}
    for round_index, (ids, params) in enumerate(jobs[job["warmup"] :]):
        sides = [("prefill", None), ("inject", params)]
        if round_index % 2:  # who goes first alternates
            sides.reverse()
        tokens = {}
        for side, side_params in sides:
            seconds, tokens[side], cached = first_token(ids, side_params)
            result[side].append(seconds)
            if side == "inject":
                result["cached"].append(cached)
        result["first_tokens_equal"].append(tokens["prefill"] == tokens["inject"])
    result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
