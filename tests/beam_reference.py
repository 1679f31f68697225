"""transformers' `_beam_search` (generation/utils.py, 5.x) for one prompt, kept in its own tensor
form (top-K over beams x vocabulary, -1e9 masks, merged top-k of finished hypotheses), over the
fake worker's beam distribution: what the scheduler's search must return, token for token."""
from __future__ import annotations

import torch

from tests.fake_worker import EOS, VOCAB, beam_distribution


def reference_beam_search(prompt: list[int], width: int, max_tokens: int,
                          length_penalty: float = 1.0, early_stopping: str = "false",
                          eos: tuple[int, ...] = (EOS,)) -> list[tuple[list[int], float]]:
    """(output tokens, length-penalised score) of each returned beam, best first."""
    k = max(2, 1 + len(eos)) * width
    prompt_len, max_length = len(prompt), len(prompt) + max_tokens
    running = torch.full((width, max_length), -1, dtype=torch.int64)
    running[:, :prompt_len] = torch.tensor(prompt)
    sequences = running.clone()
    running_scores = torch.zeros(width)
    running_scores[1:] = -1e9
    beam_scores = torch.full((width,), -1e9)
    finished = torch.zeros(width, dtype=torch.bool)
    unsatisfied, cur_len = True, prompt_len
    eos_t = torch.tensor(eos)
    while True:
        log_probs = torch.full((width, VOCAB), float("-inf"))
        for i in range(width):
            for token, value in beam_distribution(running[i, :cur_len].tolist()):
                log_probs[i, token] = value
        acc = (log_probs + running_scores[:, None]).reshape(-1)
        topk_lp, topk_idx = torch.topk(acc, k)
        tokens = topk_idx % VOCAB
        topk_seqs = running[topk_idx // VOCAB].clone()
        topk_seqs[:, cur_len] = tokens
        hits = torch.isin(tokens, eos_t) | (cur_len + 1 >= max_length)
        running_lp = topk_lp + hits.float() * -1e9
        keep = torch.topk(running_lp, width)[1]
        running, running_scores = topk_seqs[keep], running_lp[keep]
        top_mask = torch.arange(k) < width
        just = hits & top_mask
        scores = topk_lp / ((cur_len + 1 - prompt_len) ** length_penalty)
        if bool(finished.all()) and early_stopping == "true":
            scores = scores - 1e9
        if not unsatisfied:
            scores = scores - 1e9
        scores = scores + (~just).float() * -1e9
        merged = torch.cat((beam_scores, scores))
        best = torch.topk(merged, width)[1]
        sequences = torch.cat((sequences, topk_seqs))[best]
        beam_scores = merged[best]
        finished = torch.cat((finished, just))[best]
        cur_len += 1
        best_len = (max_length if early_stopping == "never" and length_penalty > 0 else cur_len) - prompt_len
        best_possible = running_scores[0] / (best_len ** length_penalty)
        worst = torch.where(finished, beam_scores.min(), torch.tensor(-1e9))
        unsatisfied = unsatisfied and bool((best_possible > worst).any())
        open_beam = not (bool(finished.all()) and early_stopping == "true")
        if not (unsatisfied and open_beam and not bool(hits.all())):
            break
    out = []
    for seq, score in zip(sequences.tolist(), beam_scores.tolist()):
        tokens = seq[prompt_len:]
        out.append((tokens[:tokens.index(-1)] if -1 in tokens else tokens, score))
    return out
