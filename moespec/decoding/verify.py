"""Verification of drafted tokens against one target pass of k + 1 tokens.

Greedy: accept drafts while they equal the target's argmax, then emit the target's own token.
Sampling: exact speculative sampling (Leviathan et al., 2023; Chen et al., 2023): accept draft
d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection emit a token from the
normalised residual (p_i - q_i)+; when all k are accepted, emit a bonus token from p_{k+1}.
The emitted tokens are then distributed exactly as the target's own sampling.
Keyed sampling (a seeded request): the target's race winner at each position is a function of
the seed and p alone, so drafts are accepted while they equal it, and the emitted tokens are
those of plain keyed decoding, token for token.
"""

import torch

from moespec.decoding.sampling import Sampler, greedy_tokens


def verify(
    drafts: list[int],
    target_logits: torch.Tensor,
    sampler: Sampler,
    draft_probs: torch.Tensor | None = None,
    position: int | None = None,
) -> tuple[int, list[int]]:
    """Return (accepted, emitted): the number of drafts accepted and the tokens the step emits
    (the accepted drafts, then one token from the target).

    target_logits: [k + 1, V], the target's logits after the current token and after each draft.
    draft_probs: [k, V], the drafter's distribution of each draft; None for a deterministic
    drafter (a point mass on each proposed token).
    position: the position of the first token the step emits; a keyed sampler's race winners
    are keyed by it (moespec.decoding.sampling.Sampler), and a draft is accepted exactly when
    it equals the winner at its position, as greedy verification accepts the argmax.
    """
    k = len(drafts)
    if target_logits.shape[0] != k + 1:
        raise ValueError(
            f"need k + 1 = {k + 1} rows of target logits, got {target_logits.shape[0]}"
        )
    if sampler.greedy or sampler.keyed:
        if sampler.greedy:
            best = greedy_tokens(target_logits)
        else:
            if position is None:
                raise ValueError("a keyed sampler verifies at a position; none was given")
            best = sampler.race(sampler.probabilities(target_logits), position)
        accepted = 0
        while accepted < k and drafts[accepted] == best[accepted]:
            accepted += 1
        return accepted, drafts[:accepted] + [best[accepted]]

    p = sampler.probabilities(target_logits)  # [k + 1, V]
    for i, token in enumerate(drafts):
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        ratio = float(p[i, token]) / q_token if q_token > 0 else 0.0
        if torch.rand((), generator=sampler.generator).item() < min(1.0, ratio):
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[token] = 0.0
        else:
            residual = (p[i] - draft_probs[i]).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q: the rejection had probability 0; fall back to p
            residual = p[i]
        return i, drafts[:i] + [sampler.draw(residual / residual.sum())]
    return k, drafts + [sampler.draw(p[k])]
