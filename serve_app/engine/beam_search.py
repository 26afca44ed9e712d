"""Beam search over forked sequences that share their KV blocks.

Each step ranks every (beam, token) extension by cumulative log-probability, keeps the best
`width` that do not end in EOS as the next beams (a parent used twice is forked, sharing its
blocks copy-on-write), and files EOS endings among the top `width` as finished hypotheses.
Hypotheses are scored as cum_logprob / output_len ** length_penalty, as transformers does.
"""

from __future__ import annotations

import torch

from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.params import FinishReason
from serve_app.engine.sequence import Request, Sequence


def score(seq: Sequence, length_penalty: float) -> float:
    return seq.cumulative_logprob / max(seq.num_output_tokens, 1) ** length_penalty


def _add_hypothesis(request: Request, seq: Sequence, width: int) -> None:
    request.beam_hypotheses.append((score(seq, request.params.length_penalty), seq))
    request.beam_hypotheses.sort(key=lambda h: h[0], reverse=True)
    del request.beam_hypotheses[width:]


def beam_step(
    request: Request, logprobs: torch.Tensor, kv: KVCacheManager, eos_ids: set[int]
) -> list[Sequence]:
    """Advance the beams of `request` by one token; returns the new live beams."""
    params = request.params
    width = params.best_of
    beams = request.seqs
    vocab = logprobs.shape[1]
    cum = torch.tensor([b.cumulative_logprob for b in beams], dtype=logprobs.dtype)
    scores = (cum[:, None] + logprobs.cpu()).flatten()
    top_scores, top_index = scores.topk(min(2 * width, scores.numel()))
    chosen: list[tuple[int, int, float]] = []
    for rank, (value, index) in enumerate(
        zip(top_scores.tolist(), top_index.tolist(), strict=True)
    ):
        parent, token = divmod(index, vocab)
        if token in eos_ids and not params.ignore_eos:
            if rank < width:
                done = Sequence(beams[parent].token_ids + [token], beams[parent].num_prompt_tokens)
                done.cumulative_logprob = value
                done.finish_reason = FinishReason.EOS
                _add_hypothesis(request, done, width)
            continue
        chosen.append((parent, token, value))
        if len(chosen) == width:
            break
    # Fork for every reuse of a parent before any parent changes, then extend in place.
    first_use: dict[int, int] = {}
    new_beams: list[Sequence] = []
    for parent, _, _ in chosen:
        if parent in first_use:
            new_beams.append(kv.fork(beams[parent]))
        else:
            first_use[parent] = len(new_beams)
            new_beams.append(beams[parent])
    for beam, (_, token, value) in zip(new_beams, chosen, strict=True):
        beam.token_ids.append(token)
        beam.cumulative_logprob = value
    for i, beam in enumerate(beams):
        if i not in first_use:
            kv.free(beam)
    for index, beam in enumerate(new_beams):
        beam.index = index
    return new_beams


def is_done(request: Request, beams: list[Sequence]) -> bool:
    """No live beam can beat the worst kept hypothesis any more (transformers' heuristic)."""
    hypotheses = request.beam_hypotheses
    if len(hypotheses) < request.params.best_of or not beams:
        return not beams
    best_live = max(score(b, request.params.length_penalty) for b in beams)
    return best_live <= hypotheses[-1][0]


def finish(request: Request, beams: list[Sequence], kv: KVCacheManager) -> list[Sequence]:
    """Close the search: live beams join the hypotheses; return the n best, best first."""
    width = request.params.best_of
    for beam in beams:
        kv.free(beam)
        if beam.finish_reason is None:
            beam.finish_reason = FinishReason.LENGTH
        _add_hypothesis(request, beam, width)
    best = [seq for _, seq in request.beam_hypotheses[: request.params.n]]
    for index, seq in enumerate(best):
        seq.index = index
    return best
