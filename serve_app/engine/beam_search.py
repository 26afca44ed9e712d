"""Beam search over forked sequences that share their KV blocks.

Each step ranks every (beam, token) extension by cumulative log-probability, keeps the best
`width` that do not end in EOS as the next beams (a parent used twice is forked, sharing its
blocks copy-on-write), and files EOS endings among the top `width` as finished hypotheses.
Hypotheses are scored as cum_logprob / output_len ** length_penalty, as transformers does.
When the request asks for logprobs, every new token records its log-probability under its
parent beam's row and that row's best alternatives; a fork copies its parent's history first.
"""

from __future__ import annotations

import torch

from serve_app.engine.kv_cache import KVCacheManager
from serve_app.engine.outputs import TokenLogprob
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
    """Advance the beams of `request` by one token; returns the new live beams.

    `logprobs` holds one log-softmaxed row per beam, in the order of `request.seqs`.
    """
    params = request.params
    width = params.best_of
    beams = request.seqs
    vocab = logprobs.shape[1]
    rows = logprobs.cpu()
    cum = torch.tensor([b.cumulative_logprob for b in beams], dtype=rows.dtype)
    scores = (cum[:, None] + rows).flatten()
    top_scores, top_index = scores.topk(min(2 * width, scores.numel()))
    record = _token_logprobs(rows, top_index, params.logprobs)
    chosen: list[tuple[int, int, float, TokenLogprob | None]] = []
    for rank, (value, index) in enumerate(
        zip(top_scores.tolist(), top_index.tolist(), strict=True)
    ):
        parent, token = divmod(index, vocab)
        entry = record(rank, parent) if record is not None else None
        if token in eos_ids and not params.ignore_eos:
            if rank < width:
                done = Sequence(beams[parent].token_ids + [token], beams[parent].num_prompt_tokens)
                done.cumulative_logprob = value
                done.finish_reason = FinishReason.EOS
                if entry is not None:
                    done.logprobs = list(beams[parent].logprobs) + [entry]
                _add_hypothesis(request, done, width)
            continue
        chosen.append((parent, token, value, entry))
        if len(chosen) == width:
            break
    # Fork for every reuse of a parent before any parent changes, then extend in place: a fork
    # copies the parent's token ids and logprobs as they were before this step.
    first_use: dict[int, int] = {}
    new_beams: list[Sequence] = []
    for parent, _, _, _ in chosen:
        if parent in first_use:
            new_beams.append(kv.fork(beams[parent]))
        else:
            first_use[parent] = len(new_beams)
            new_beams.append(beams[parent])
    for beam, (_, token, value, entry) in zip(new_beams, chosen, strict=True):
        beam.token_ids.append(token)
        beam.cumulative_logprob = value
        if entry is not None:
            beam.logprobs.append(entry)
    for i, beam in enumerate(beams):
        if i not in first_use:
            kv.free(beam)
    for index, beam in enumerate(new_beams):
        beam.index = index
    return new_beams


def _token_logprobs(rows: torch.Tensor, top_index: torch.Tensor, num_top: int | None):
    """None when logprobs are not asked for; else rank, parent -> the candidate's TokenLogprob.

    One topk over the beam rows gives every parent's best `num_top` alternatives (best first,
    as the sampler reports them); the candidates' own log-probabilities are one gather.
    """
    if num_top is None:
        return None
    vocab = rows.shape[1]
    tokens = (top_index % vocab).tolist()
    values = rows.flatten()[top_index].tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in range(rows.shape[0])]
    if num_top:
        best, ids = rows.topk(min(num_top, vocab), dim=1)
        top = [
            list(zip(r_ids, r_vals, strict=True))
            for r_ids, r_vals in zip(ids.tolist(), best.tolist(), strict=True)
        ]

    def record(rank: int, parent: int) -> TokenLogprob:
        return TokenLogprob(tokens[rank], values[rank], list(top[parent]))

    return record


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
