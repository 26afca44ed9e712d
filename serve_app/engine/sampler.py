"""Vectorized sampling over a batch of rows, each with its own parameters.

Greedy rows take an argmax; sampled rows go through temperature, top-k, top-p, and the
exponential-race draw (argmax of p / E with E ~ Exp(1)), whose noise comes from the row's own
generator when it has a seed, so a seeded request samples the same tokens whatever shares its
batch. Work that no row asks for (penalties, a full sort for top-p, log-softmax, a grammar's
mask) is skipped: the vocabulary is 151936 wide. A batch of greedy rows asking for nothing more
takes its argmax on the logits as the model computed them (bfloat16 too, as widening to float32
is exact), without a float32 copy of the step's logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from serve_app.engine.constraint import ConstraintState
from serve_app.engine.params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    constraint: ConstraintState | None = None  # the sequence's grammar state, if it has one
    remaining: int = 0  # tokens the sequence may still produce, this one included


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: torch.Tensor | None  # [N, V] raw log-softmax, when any row asked for logprobs
    chosen_logprobs: list[float] | None
    top: list[list[tuple[int, float]]] | None  # per row: top-N (token, logprob) alternatives


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow], index: list[int]) -> None:
    vocab = logits.shape[1]
    device = logits.device
    for i in index:  # per row: the histograms differ in length; one scatter each is cheap
        p = rows[i].params
        out = torch.tensor(rows[i].output_ids, dtype=torch.long, device=device)
        counts = torch.zeros(vocab, device=device).scatter_add_(
            0, out, torch.ones_like(out, dtype=torch.float)
        )
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if rows[i].prompt_ids:
                seen[torch.tensor(rows[i].prompt_ids, dtype=torch.long, device=device)] = True
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalized, row))
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).float()


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: -inf outside each row's top-k and top-p nucleus (0 / 1.0 mean off)."""
    vocab = logits.shape[1]
    k_on = (top_k > 0) & (top_k < vocab)
    if bool(k_on.any()):
        k_max = int(top_k[k_on].max())
        kth = logits.topk(k_max, dim=1).values
        k = torch.where(k_on, top_k, k_max).clamp(max=k_max) - 1
        threshold = kth.gather(1, k[:, None])
        threshold = torch.where(k_on[:, None], threshold, float("-inf"))
        logits.masked_fill_(logits < threshold, float("-inf"))
    p_on = top_p < 1.0
    if bool(p_on.any()):
        sub = logits[p_on]
        sorted_logits, order = sub.sort(dim=1, descending=True)
        probs = sorted_logits.softmax(dim=1)
        before = probs.cumsum(dim=1) - probs  # mass strictly above each token
        drop = before > top_p[p_on][:, None]  # the first token always stays
        sorted_logits.masked_fill_(drop, float("-inf"))
        logits[p_on] = sub.scatter(1, order, sorted_logits)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=1)


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """argmax: each row's first maximum of a 2-D tensor, as torch's (the device backend's,
        which may be faster)."""
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.argmax = argmax or _argmax

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SampleRow],
        num_top: int = 0,
        need_logprobs: bool = False,
    ) -> SampleResult:
        penalized = [
            i
            for i, r in enumerate(rows)
            if r.params.repetition_penalty != 1.0
            or r.params.presence_penalty
            or r.params.frequency_penalty
        ]
        masked = [i for i, r in enumerate(rows) if r.constraint is not None]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not (need_logprobs or num_top or penalized or masked or sampled):
            return SampleResult(self.argmax(logits).tolist(), None, None, None)
        copied = logits.dtype != torch.float32  # widening makes a tensor of our own
        logits = logits.float()
        device = logits.device
        logprobs = None
        if need_logprobs or num_top:
            logprobs = torch.log_softmax(logits, dim=-1)
        if (penalized or masked) and not copied:
            logits = logits.clone()  # edited in place below; the caller's tensor stays intact
        if penalized:
            _apply_penalties(logits, rows, penalized)
        for i in masked:  # after the penalties: a state ranking candidates sees the final row
            rows[i].constraint.mask(logits[i], rows[i].output_ids, rows[i].remaining)
        tokens = self.argmax(logits)
        if sampled:
            idx = torch.tensor(sampled, device=device)
            sub = logits[idx]
            params = [rows[i].params for i in sampled]
            sub /= torch.tensor([p.temperature for p in params], device=device)[:, None]
            _top_k_top_p(
                sub,
                torch.tensor([p.top_k for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device, dtype=torch.float),
            )
            probs = sub.softmax(dim=1)
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(sampled) if rows[i].generator is None]
            if shared:
                noise[shared] = torch.empty(
                    len(shared), probs.shape[1], device=device
                ).exponential_(generator=self.generator)
            for j, i in enumerate(sampled):
                if rows[i].generator is not None:
                    noise[j].exponential_(generator=rows[i].generator)
            tokens[idx] = self.argmax(probs / noise)
        token_ids = tokens.tolist()
        chosen = top = None
        if logprobs is not None:
            chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            if num_top:
                values, ids = logprobs.topk(num_top, dim=1)
                top = [
                    list(zip(r_ids, r_vals, strict=True))
                    for r_ids, r_vals in zip(ids.tolist(), values.tolist(), strict=True)
                ]
        return SampleResult(token_ids, logprobs, chosen, top)
