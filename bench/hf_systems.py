"""transformers' own ways of generating, as bench/engine.py runs them against our engine:
continuous batching (`generate_batch`), `generate` on a static batch and one prompt at a time,
and a bare forward loop over a DynamicCache; each greedy, EOS-free, every request all its
output tokens."""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

from bench.common import gaps


class TokenTimer(BaseStreamer):
    """A generate() streamer that timestamps every put(): the prompt, then each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def token_gaps(self) -> list[float]:
        """Seconds between consecutive generated tokens (times[0] is the prompt, before prefill)."""
        return gaps(self.times[1:])


def _page_field(config_type=ContinuousBatchingConfig) -> str:
    """The CB config's name for its KV page size: `page_size`, `block_size` before
    transformers 5.2x (the GPU machines' own transformers is 5.17)."""
    names = {f.name for f in dataclasses.fields(config_type)}
    return "page_size" if "page_size" in names else "block_size"


def cb_config(args, config_type=ContinuousBatchingConfig) -> ContinuousBatchingConfig:
    per_seq = -(-(args.prompt_len + args.output_len) // args.cb_page_size) + 1
    return config_type(
        **{_page_field(config_type): args.cb_page_size},
        num_blocks=args.requests * per_seq,  # unset, CPU sizes it from host memory
        max_batch_tokens=args.prefill_tokens,
        max_requests_per_batch=args.requests,
    )


def cb_page_size(config) -> int:
    return getattr(config, _page_field(type(config)))


def run_hf_cb(model, prompts, output_len: int, config: ContinuousBatchingConfig):
    """transformers continuous batching. Not under inference_mode: its worker thread updates
    tensors in place that the calling thread created, which inference tensors forbid."""
    gen_config = GenerationConfig(
        max_new_tokens=output_len,
        do_sample=False,
        eos_token_id=-1,  # -1 disables EOS in generate_batch (None falls back to the model's)
        pad_token_id=0,  # no padding is generated: every request gets all output_len tokens
    )
    results = model.generate_batch(
        inputs=prompts,
        generation_config=gen_config,
        continuous_batching_config=config,
        progress_bar=False,
        persistent_manager=True,  # the warm-up's manager (cache, thread set-up) is reused
    )
    out = list(results.values())
    errors = [r.error for r in out if r.error is not None]
    if len(out) != len(prompts) or errors:
        raise RuntimeError(f"generate_batch: {len(out)}/{len(prompts)} results; {errors[:2]}")
    return [list(r.generated_tokens) for r in out]


def hf_generate_config(model, output_len: int) -> GenerationConfig:
    eos_ids = model.generation_config.eos_token_id
    return GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=0,  # no padding is generated: every request gets all output_len tokens
        eos_token_id=eos_ids,  # min_new_tokens keeps them from ending a request early
    )


@torch.inference_mode()
def run_hf_static(model, prompts, output_len: int) -> list[list[int]]:
    device = model.device
    ids = torch.tensor(prompts, device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=hf_generate_config(model, output_len),
    )
    return out[:, ids.shape[1] :].tolist()


@torch.inference_mode()
def run_hf_one_at_a_time(model, prompts, output_len: int, token_gaps: list[float] | None = None):
    device, results = model.device, []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        timer = TokenTimer()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=hf_generate_config(model, output_len),
            streamer=timer,
        )
        results.append(out[0, ids.shape[1] :].tolist())
        if token_gaps is not None:
            token_gaps.extend(timer.token_gaps())
    return results


@torch.inference_mode()
def run_bare_loop(model, prompts, output_len: int) -> list[list[int]]:
    """One prefill forward, then output_len - 1 decode forwards of [B, 1]; argmax, nothing else."""
    ids = torch.tensor(prompts, device=model.device)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    tokens = [token]
    for _ in range(output_len - 1):
        logits = model(
            input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1
        ).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1).tolist()
