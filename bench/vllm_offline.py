"""The vLLM side of `bench/engine.py --peers vllm`: run by the vLLM venv's python, not ours.

    python bench/vllm_offline.py JOB.json RESULT.json

JOB: {model_dir, dtype, max_model_len, max_num_seqs, output_len, warm_prompts, prompt_sets,
warmup_tokens}; prompts are lists of token ids. It builds `vllm.LLM` on the same weights, runs
the warm-up prompts for warmup_tokens, then each prompt set (greedy, EOS ignored, output_len
tokens) and writes {seconds: [...], tokens: [[...], ...] (the last set's), vllm: version}. vLLM
starts worker processes, hence the `__main__` guard.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(open(job_path).read())
    llm = LLM(
        model=job["model_dir"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        seed=0,
    )

    def run(prompts: list[list[int]], tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    run(job["warm_prompts"], job["warmup_tokens"])
    seconds, tokens = [], []
    for prompts in job["prompt_sets"]:
        start = time.perf_counter()
        tokens = run(prompts, job["output_len"])
        seconds.append(time.perf_counter() - start)
    result = {"seconds": seconds, "tokens": tokens, "vllm": vllm.__version__}
    with open(result_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
