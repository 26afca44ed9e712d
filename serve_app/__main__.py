"""`python -m serve_app`: until the Ray Serve graph lands, an offline generation on the demo model.

Builds the demo model if needed, loads the engine, and generates a chat reply for a few prompts
with continuous batching, printing the text and the throughput.
"""

from __future__ import annotations

import argparse
import time

from serve_app.engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="demo", help="modelWeightPath: demo, or a folder")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    print("serve_app: the HTTP server is not built yet; running an offline generation instead.")
    llm = LLM(args.model, dtype=args.dtype)
    questions = ["Hello! Who are you?", "用一句话介绍一下你自己。", "Write a haiku about NPUs."]
    prompts = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        prompts, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=args.max_tokens)
    )
    elapsed = time.perf_counter() - start
    for question, output in zip(questions, outputs, strict=True):
        completion = output.outputs[0]
        print(f"\n> {question}\n{completion.text!r}  [{completion.finish_reason.value}]")
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{produced} tokens in {elapsed:.2f} s ({produced / elapsed:.1f} tokens/s, "
        f"{llm.engine.runner.device}, {llm.engine.runner.dtype})"
    )


if __name__ == "__main__":
    main()
