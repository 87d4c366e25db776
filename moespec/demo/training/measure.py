"""Measurement of the trained pair: held-out loss against a unigram baseline, expert reuse
of the target's routing, and the draft's greedy acceptance against the target."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import (
    DynamicCache,
)

from moespec.demo.training.corpus import Document
from moespec.demo.training.loop import lm_loss


def unigram_loss(train_stream: torch.Tensor, chunks: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the windows' label tokens under the training unigram distribution,
    with add-one smoothing so unseen tokens have finite cost (nats/token)."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(-logp[chunks[:, 1:].reshape(-1)].mean())


@torch.no_grad()
def routing_top_k(model: torch.nn.Module, chunks: torch.Tensor, batch_size: int = 8):
    """Each layer's top-k expert ids for every input token of ``chunks``.

    Returns a tensor (layers, windows, seq_len, k) and the held-out loss of the same pass.
    """
    k = model.config.num_experts_per_tok
    per_batch, total = [], 0.0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size]
        ce, router_logits = lm_loss(model, batch, with_router=True)
        total += ce.item() * batch.shape[0]
        b, t = batch.shape[0], batch.shape[1] - 1
        per_batch.append(
            torch.stack([r.topk(k, dim=-1).indices.view(b, t, k) for r in router_logits])
        )
    return torch.cat(per_batch, dim=1), total / chunks.shape[0]


def overlap_share(prev: torch.Tensor, cur: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Per pair, the share of ``cur``'s k experts that ``prev`` also selected."""
    prev_hot = F.one_hot(prev, n_experts).sum(dim=-2)  # (..., n_experts) membership of prev
    return prev_hot.gather(-1, cur).float().mean(dim=-1)


def expert_reuse(
    top: torch.Tensor, tokens: torch.Tensor, eos_id: int, n_experts: int, seed: int
) -> dict:
    """Next-token expert reuse rho(2) per layer with its two baselines and expert shares.

    ``top``: (layers, windows, T, k) routed experts of the input tokens ``tokens`` (windows, T).
    rho(2) averages, over consecutive pairs (t-1, t) inside one document (neither token is the
    EOS separator, which also keeps pairs from straddling files), the share of t's experts that
    t-1 also used. The random-pairing baseline applies the same estimator after shuffling the
    eligible tokens of each layer (a seeded permutation): it measures what expert popularity
    alone gives. The uniform baseline is k / N.
    """
    k = top.shape[-1]
    real = tokens != eos_id
    pair_ok = real[:, 1:] & real[:, :-1]
    gen = torch.Generator().manual_seed(seed)
    rho, shuffled, max_share, shares = [], [], [], []
    for layer in top:
        rho.append(float(overlap_share(layer[:, :-1], layer[:, 1:], n_experts)[pair_ok].mean()))
        flat = layer[real]  # (tokens, k), stream order
        perm = flat[torch.randperm(flat.shape[0], generator=gen)]
        shuffled.append(float(overlap_share(perm[:-1], perm[1:], n_experts).mean()))
        share = torch.bincount(flat.reshape(-1), minlength=n_experts).double() / flat.numel()
        shares.append([round(float(s), 5) for s in share])
        max_share.append(float(share.max()))
    return {
        "rho2_per_layer": rho,
        "rho2_layer_mean": sum(rho) / len(rho),
        "random_pairing_per_layer": shuffled,
        "random_pairing_layer_mean": sum(shuffled) / len(shuffled),
        "uniform_baseline": k / n_experts,
        "max_expert_share_per_layer": max_share,
        "fair_share": 1 / n_experts,
        "expert_shares_per_layer": shares,
        "pairs": int(pair_ok.sum()),
    }


def acceptance_prompts(
    tok: Tokenizer, docs: Sequence[Document], n_prompts: int, prompt_len: int
) -> torch.Tensor:
    """``n_prompts`` distinct equal-length prompts from the held-out files.

    Candidates are the non-overlapping ``prompt_len``-token windows of each file, except the
    first (file heads are mostly license text and docstrings); the prompts are evenly spaced
    over the candidates in file order, so every file contributes about in proportion to its size.
    """
    candidates = [
        ids[j : j + prompt_len]
        for ids in (enc.ids for enc in tok.encode_batch([d.text for d in docs]))
        for j in range(prompt_len, len(ids) - prompt_len + 1, prompt_len)
    ]
    if len(candidates) < n_prompts:
        raise ValueError(f"only {len(candidates)} held-out windows for {n_prompts} prompts")
    picks = [i * len(candidates) // n_prompts for i in range(n_prompts)]
    return torch.tensor([candidates[i] for i in picks])


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts with a KV cache (no EOS stop)."""
    cache = DynamicCache(config=model.config)
    seq, step_input = prompts, prompts
    for _ in range(new_tokens):
        logits = model(input_ids=step_input, cache=cache, use_cache=True).logits[:, -1]
        step_input = logits.argmax(dim=-1, keepdim=True)
        seq = torch.cat([seq, step_input], dim=1)
    return seq


@torch.no_grad()
def greedy_acceptance(
    target: torch.nn.Module, draft: torch.nn.Module, prompts: torch.Tensor, new_tokens: int
) -> dict:
    """Per-token agreement of the draft's greedy choice with the target's greedy output.

    The target greedily continues each prompt; then, for every generated position, the draft
    sees the same context (prompt + the target's tokens so far) and we count how often its
    argmax equals the target's token. That rate is the geometric acceptance ``a`` of greedy
    speculative decoding.
    """
    seq = greedy_decode(target, prompts, new_tokens)
    p = prompts.shape[1]
    draft_pick = draft(input_ids=seq[:, :-1], use_cache=False).logits[:, p - 1 :].argmax(dim=-1)
    agree = (draft_pick == seq[:, p:]).float()
    return {
        "acceptance": float(agree.mean()),
        "per_prompt": [round(float(a), 4) for a in agree.mean(dim=1)],
        "prompts": prompts.shape[0],
        "prompt_tokens": p,
        "new_tokens": new_tokens,
    }
