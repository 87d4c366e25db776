"""The training loop: the schedule, the losses (language model plus the router's balance),
deterministic kernels and threads, and the log of a run."""

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moespec.demo.training.configs import parameter_fingerprint


@dataclass
class TrainSpec:
    """Hyper-parameters of one training run; recorded in the log so a test can replay it."""

    steps: int
    batch_size: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_coef: float = 0.05
    seed: int = 0
    log_every: int = 25
    eval_every: int = 100
    fingerprint_steps: tuple[int, ...] = (0, 5)


@dataclass
class TrainLog:
    """What ``train`` records: per-step losses, periodic held-out loss, fingerprints, time."""

    loss: list[float] = field(default_factory=list)
    balance: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    held_out: list[tuple[int, float]] = field(default_factory=list)
    fingerprints: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0


@contextlib.contextmanager
def deterministic_torch(threads: int = 2) -> Iterator[None]:
    """Fix the thread count and demand deterministic kernels; restore both on exit.

    The thread count matters: fp32 reductions split differently with more threads.
    """
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup to ``spec.lr`` then cosine decay to ``spec.lr * spec.min_lr_ratio``."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine)


def batch_indices(n_chunks: int, spec: TrainSpec) -> Iterator[torch.Tensor]:
    """Chunk indices per step: successive seeded permutations (epochs), cut into batches."""
    gen = torch.Generator().manual_seed(spec.seed)
    pending = torch.empty(0, dtype=torch.long)
    for _ in range(spec.steps):
        while pending.numel() < spec.batch_size:
            pending = torch.cat([pending, torch.randperm(n_chunks, generator=gen)])
        yield pending[: spec.batch_size]
        pending = pending[spec.batch_size :]


def balance_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style load balancing computed per layer, then averaged over layers.

    For each layer, N * sum_i f_i * P_i, where f_i is the share of the layer's top-k slots
    routed to expert i and P_i the mean router probability of expert i; 1.0 when balanced.
    Pooling counts across layers (as transformers does) lets one layer's hot expert hide
    behind another layer's cold one, so each layer is balanced on its own.
    """
    per_layer = []
    for logits in router_logits:
        probs = logits.float().softmax(dim=-1)
        n_experts = probs.shape[-1]
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        share = torch.bincount(chosen, minlength=n_experts).float() / chosen.numel()
        per_layer.append(n_experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(per_layer).mean()


def lm_loss(model: torch.nn.Module, chunk: torch.Tensor, with_router: bool):
    """Mean next-token cross-entropy of a batch of windows, plus router logits if asked."""
    kwargs = {"output_router_logits": True} if with_router else {}
    out = model(input_ids=chunk[:, :-1], use_cache=False, **kwargs)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
    return ce, (out.router_logits if with_router else None)


@torch.no_grad()
def mean_loss(model: torch.nn.Module, chunks: torch.Tensor, batch_size: int = 8) -> float:
    """Token-weighted mean cross-entropy over equal-length windows (nats/token)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size]
        ce, _ = lm_loss(model, batch, with_router=False)
        total += ce.item() * batch.shape[0]
    model.train(was_training)
    return total / chunks.shape[0]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay the matrices (incl. 3D expert weights), not the norm gains."""
    decay = [p for _, p in sorted(model.named_parameters()) if p.ndim >= 2]
    no_decay = [p for _, p in sorted(model.named_parameters()) if p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def train(
    model: torch.nn.Module,
    chunks: torch.Tensor,
    spec: TrainSpec,
    eval_chunks: torch.Tensor | None = None,
    stop_after: int | None = None,
    echo: Callable[[str], None] | None = print,
    name: str = "model",
) -> TrainLog:
    """AdamW over seeded batches of ``chunks``; returns the loss curves and fingerprints.

    ``stop_after`` ends the run early without changing anything about the steps it does run
    (the schedule still spans ``spec.steps``), which is how the test replays the first steps.
    Fingerprints are taken *after* ``k`` optimizer steps for each ``k`` in
    ``spec.fingerprint_steps`` (0 = the initial weights).
    """
    is_moe = getattr(model.config, "num_experts", 0) > 0
    top_k = getattr(model.config, "num_experts_per_tok", 0)
    opt = torch.optim.AdamW(
        param_groups(model, spec.weight_decay), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8
    )
    log = TrainLog()
    model.train()
    start = time.perf_counter()
    last_steps = stop_after if stop_after is not None else spec.steps
    for step, idx in enumerate(batch_indices(chunks.shape[0], spec)):
        if step in spec.fingerprint_steps:
            log.fingerprints[f"step_{step}"] = parameter_fingerprint(model)
        if step >= last_steps:
            break
        lr = lr_at(step, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = chunks[idx]
        ce, router_logits = lm_loss(model, batch, with_router=is_moe)
        bal = balance_loss(router_logits, top_k) if is_moe else torch.zeros(())
        (ce + spec.balance_coef * bal).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.loss.append(round(ce.item(), 5))
        log.balance.append(round(bal.item(), 5))
        log.lr.append(lr)
        log.tokens += batch[:, :-1].numel()
        done = step + 1
        if eval_chunks is not None and (done % spec.eval_every == 0 or done == spec.steps):
            log.held_out.append((done, round(mean_loss(model, eval_chunks), 5)))
        if echo and (done % spec.log_every == 0 or done == last_steps):
            elapsed = time.perf_counter() - start
            recent = log.loss[-spec.log_every :]
            held = f" held-out {log.held_out[-1][1]:.3f}" if log.held_out else ""
            echo(
                f"[{name}] step {done}/{spec.steps} loss {sum(recent) / len(recent):.3f} "
                f"bal {bal.item():.3f} lr {lr:.2e}{held} "
                f"{log.tokens / elapsed:,.0f} tok/s {elapsed:.0f}s"
            )
    else:
        if spec.steps in spec.fingerprint_steps:
            log.fingerprints[f"step_{spec.steps}"] = parameter_fingerprint(model)
    log.seconds = time.perf_counter() - start
    return log
