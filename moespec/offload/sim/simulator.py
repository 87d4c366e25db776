"""Trace-driven simulation of offloaded MoE decoding on a hardware profile.

Steps. With speculation (draft length k, geometric acceptance a, seeded) a step drafts k tokens
and verifies the next n = k + 1 tokens of the trace in one pass (fewer at a document's end);
j ~ min(Geometric, k) drafts are accepted and the step emits j + 1 tokens, which advance the
trace. Rejected drafts (the pass's tokens after the first rejection) are not the trace's next
tokens: `rejected_routing` says how they are routed. "trace": from an array of the target's
routing of the tokens a real draft proposed at each position (`simulate(..., rejected=ids)`);
"popularity" (default without one): each slot drawn from the layer's expert frequencies in the
fit split, m distinct experts per token, from a generator of its own; "continuation": like the
trace's next tokens (an upper bound on any lookahead). The acceptance draws depend on the seed only,
so every policy sees the same steps. A policy with `speculative = False` runs plain decoding:
n = 1, no draft. The first `fit_tokens` tokens of the trace are the fit split (policies' `fit`),
the rest is replayed.

The draft length k is a cap (`draft_stop` says how often a step stops short of it). llama.cpp,
on which seed 003's system and its llama.cpp baseline run (the authors' release starts
`llama-server ... --draft-max 8`), stops drafting at the first token whose draft probability
is under `--draft-p-min` (0.75 by default; `common/speculative.cpp`), so a step drafts fewer
tokens where the draft is unsure, which is mostly where it is wrong. The reading here: right
after the first drafted token the target rejects, drafting stops with probability
`draft_stop` (the stop's recall; it never stops before a token the target accepts, an
idealisation), so the step drafts and verifies up to that token: n = j + 2 for j accepted.
0 (the default): every step drafts k tokens, seed 003 eq. 2's T_SD = gamma T_D + T_V. The stop
draws come from a generator of their own, so draft_stop = 0 leaves every other draw as it was
and every policy sees the same steps at any value.

Timing model (one, for every policy). Expert e of MoE layer l with c_e slots in the pass,
w_l its bytes, q_l = 2 w_l / (bytes per parameter) its FLOPs per token:

    accelerator   a_l(c) = phi_acc + w_l / B_acc + c q_l / F_acc
    CPU           g_l(c) = phi_cpu + w_l / B_cpu + c q_l / F_cpu
    kernel call   kappa once per layer for each tier with experts (the engine's dispatch)
    bookkeeping   epsilon once per layer (the profile's offload_layer_time: the engine's own
                  work around its kernels and decisions, on the critical path), and
                  offload_split_time more where both tiers have experts
    copy          x_l    = lambda_link + w_l / B_link      (one copy engine, copies in sequence)
    hidden states z      = 2 (lambda_link + n d 2 / B_link) per layer with CPU experts (d: hidden)
    dense         d_l    = phi_layer + (n - 1) phi_token + D_l / B_acc   (attention, router,
                                                shared experts: D_l bytes per layer; phi_layer:
                                                launches, synchronisation; phi_token: work per
                                                pass token, 0 on the GPU profiles)
    draft         h(k)   = k (phi_draft + D_draft / B_acc)   (the draft model on the accelerator)
    step          phi_step after the last layer (LM head, sampling)

A step starting at t0 drafts on the accelerator until t0 + h(k); layer l of the pass starts at
t_l (t_0 = t0 + h(k)) and its router output is known at r_l = t_l + d_l, when the policy plans.
The link runs all the while: on-demand fetches first, in the order planned, then prefetches as
the policy's queue yields them, each starting when the link is free (prefetches overlap the
draft and earlier layers; a copy holds its cache bytes from its start). Then, in parallel:

    accelerator  G_l = r_l + kappa + sum of a_l over experts arrived by r_l, then for each awaited
                 expert in order of arrival: G_l = max(G_l, arrival) + a_l(c); with the
                 profile's await_all_copies (a CPU engine's one kernel call per layer), G_l =
                 max(r_l + C_l, last arrival) + kappa + the sum of a_l over all its experts,
                 the CPU tier first (the tiers' turns then in sequence: no min(...) term).
                 With compute_while_reading (the disk tier computing on arrival), where a
                 copy is still awaited at r_l: the experts in by r_l first, G = r_l + kappa
                 + their a_l; then the CPU tier, G = G + C_l - r_l; then, while some are
                 awaited, G = max(G, first awaited arrival) and the experts in by then in
                 one call, G = G + kappa + their a_l (turns in sequence, as above); the wait
                 is the sum of the max(...) terms' idle time. Without an awaited copy, the
                 same sum as await_all_copies
    CPU          C_l = r_l + kappa + z + sum of g_l over the CPU experts, stretched by contention
    layer end    t_{l+1} = max(G_l, C_l) + epsilon + (1 - o) (min(G_l - r_l, C_l - r_l) + X_l)
                 (o: the profile's tier overlap, 1 for two devices; below 1 where one
                 processor computes both tiers and makes the copies, as on `this-machine`;
                 X_l: the link's busy time in the layer that the accelerator did not wait
                 for, times the profile's link_cpu_share: the part of a copy that occupies the
                 processor; z is 0 where the profile's hidden_link is off)

Host-memory contention (profile's B_host > 0): the CPU's expert reads and the copy engine share
host memory. While the link copies, the CPU reads weights at min(B_cpu, B_host - B_link): the
weight-reading part M of C_l, with a share rho of [r_l, r_l + C_l] overlapped by copies, takes
M (1 - rho) + M rho B_cpu / min(B_cpu, B_host - B_link). Copies keep their pace (the DMA engine
is not throttled), an assumption. The step ends at t_L + phi_step; tokens/s = emitted tokens
/ total time. A profile with `decisions_on_clock` (this machine: the engine's policy runs in
Python on the cores that compute) adds the measured CPU time of each layer's policy and
driver calls (plan, fetch admission, finish) to the virtual clock. The accelerator's memory is
its own, and the link's other direction (hidden states) free.
"""

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from moespec.offload.driver import LayerDriver, OffloadStats, expert_cache_budget
from moespec.offload.policies.base import ExpertCache, LayerTiming
from moespec.offload.sim.hardware import HardwareProfile
from moespec.offload.sim.metrics import AccuracyMeter, SmapeMeter


@dataclass
class SimulationSettings:
    cache_ratio: float = 0.25  # cache budget: this share of all expert bytes
    draft_length: int = 8  # k
    acceptance: float = 0.7  # a
    tokens: int = 2048  # tokens to emit (fewer if the replayed trace ends first)
    seed: int = 0
    fit_tokens: int = 0  # the trace's first tokens, for `fit`; not replayed
    draft_bytes_ratio: float = 0.08  # draft model bytes / all expert bytes (seed 003 A.1: 8%)
    dense_bytes_per_layer: float = 0.0  # D_l
    hidden_size: int = 0  # d; 0: hidden-state round trips cost the link latency only
    bytes_per_parameter: float = 2.0  # bf16
    rejected_routing: str = "popularity"  # or "continuation"; "trace" when given an array
    record: bool = False  # keep a per-layer log (for checks; slow and large on long runs)
    # The accepted drafts of each step, replayed instead of the seeded draws (a measured run's,
    # so that simulation and measurement take the same steps); steps past its end: k.
    accepted: tuple[int, ...] | None = None
    # After the first rejected draft, the chance the draft stops (llama.cpp's confidence stop,
    # read as in the module docstring); 0: every step drafts draft_length tokens.
    draft_stop: float = 0.0

    def __post_init__(self):
        if not 0 <= self.cache_ratio <= 1:
            raise ValueError(f"cache ratio must be in [0, 1], got {self.cache_ratio}")
        if self.draft_length < 0:
            raise ValueError(f"draft length must be >= 0, got {self.draft_length}")
        if not 0 <= self.acceptance < 1:
            raise ValueError(f"acceptance must be in [0, 1), got {self.acceptance}")
        if not 0 <= self.draft_stop <= 1:
            raise ValueError(f"draft stop must be in [0, 1], got {self.draft_stop}")
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        if self.rejected_routing not in ("popularity", "continuation", "trace"):
            raise ValueError(
                "rejected routing must be popularity, continuation or trace, "
                f"got {self.rejected_routing!r}"
            )


@dataclass
class SimulationResult:
    policy: str
    tokens: int
    steps: int
    seconds: float
    stats: OffloadStats  # the layer driver's counts (the engine reports the same)
    preload_bytes: int
    peak_cache_bytes: int
    budget_bytes: int
    accuracy: float | None
    smape: float | None
    previous_pass_accuracy: float | None  # the forecast "hot = active in the previous pass"
    policy_stats: dict = field(default_factory=dict)
    log: dict | None = None
    pass_seconds: float = 0.0  # the passes' MoE layers (router output to layer end, and dense)
    draft_seconds: float = 0.0
    num_layers: int = 1
    drafted_tokens: int = 0  # tokens drafted over all steps (below steps x k under a stop)

    @property
    def layer_ms(self) -> float:
        """Mean time of one decoder layer of a pass (the paper's "layer profile", App. G)."""
        return 1e3 * self.pass_seconds / max(self.steps * self.num_layers, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def latency_per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float:
        return self.stats.hit_rate

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "tokens_per_second": self.tokens_per_second,
            "latency_per_token_ms": self.latency_per_token * 1e3,
            "hit_rate": self.hit_rate,
            "hot_cold_accuracy": self.accuracy,
            "previous_pass_hot_cold_accuracy": self.previous_pass_accuracy,
            "frequency_smape": self.smape,
            "tokens": self.tokens,
            "steps": self.steps,
            "seconds": self.seconds,
            "layer_ms": self.layer_ms,
            "draft_seconds": self.draft_seconds,
            "drafted_tokens": self.drafted_tokens,
            "pass_seconds": self.pass_seconds,
            "num_layers": self.num_layers,
            **self.stats.to_dict(),
            "needed_experts": self.stats.needed,
            "preload_bytes": self.preload_bytes,
            "peak_cache_bytes": self.peak_cache_bytes,
            "budget_bytes": self.budget_bytes,
            **self.policy_stats,
        }


class _Costs:
    """Per-layer unit times of the timing model (see module docstring)."""

    def __init__(self, trace, profile: HardwareProfile, s: SimulationSettings):
        w = np.asarray(trace.expert_bytes, dtype=float)  # [L]
        q = 2 * w / s.bytes_per_parameter
        p = profile
        self.acc_expert = p.accelerator_expert_time + w / p.accelerator_bandwidth
        self.acc_slot = q / p.accelerator_flops
        self.acc_slot_alone = q / (p.accelerator_flops_alone or p.accelerator_flops)
        self.cpu_expert = p.cpu_expert_time + w / p.cpu_bandwidth
        self.cpu_slot = q / p.cpu_flops
        self.copy = p.link_latency + w / p.link_bandwidth
        self.dense = p.layer_time + s.dense_bytes_per_layer / p.accelerator_bandwidth
        self.layer_token = p.layer_token_time
        self.kernel_call = p.kernel_call_time
        self.bookkeeping, self.split = p.offload_layer_time, p.offload_split_time
        self.step = p.step_time
        self.cpu_read = w / p.cpu_bandwidth  # the weight-reading part of g_l
        self.cpu_slowdown = 1.0
        if p.host_memory_bandwidth > 0:
            left = p.host_memory_bandwidth - p.link_bandwidth  # > 0: the profile checks it
            self.cpu_slowdown = p.cpu_bandwidth / min(p.cpu_bandwidth, left)
        self.link_latency, self.link_bandwidth = p.link_latency, p.link_bandwidth
        self.tier_overlap, self.decisions_on_clock = p.tier_overlap, p.decisions_on_clock
        self.hidden_bytes_per_token = 2 * s.hidden_size
        self.hidden_link, self.link_cpu_share = p.hidden_link, p.link_cpu_share
        self.await_all_copies = p.await_all_copies
        self.compute_while_reading = p.compute_while_reading
        draft_bytes = s.draft_bytes_ratio * trace.num_experts * w.sum()
        self.draft_token = p.draft_token_time + draft_bytes / p.accelerator_bandwidth

    def hidden_round_trip(self, n_tokens: int) -> float:
        if not self.hidden_link:
            return 0.0
        return 2 * (
            self.link_latency + n_tokens * self.hidden_bytes_per_token / self.link_bandwidth
        )


class _Link:
    """The driver's back end: one copy engine, copies in sequence on the virtual clock;
    on-demand fetches go first, then the prefetch queue whenever the link is free."""

    def __init__(self, costs: _Costs, log):
        self.costs, self.log = costs, log
        self.driver: LayerDriver | None = None
        self.free_at = self._start = 0.0
        self.layer_copy_seconds = 0.0
        self.layer_copies = 0
        self.busy = deque(maxlen=256)  # (start, end) of the latest copies, in start order

    # Back-end hooks (called by the driver from `admit`).
    def arrival(self, layer: int, now: float) -> float:
        return now + self.costs.copy[layer]

    def copy_started(self, layer: int, expert: int, kind: str) -> None:
        seconds = self.costs.copy[layer]
        self.free_at = self._start + seconds
        self.busy.append((self._start, self.free_at))
        self.layer_copy_seconds += seconds
        self.layer_copies += 1
        if self.log is not None:
            nbytes = int(self.driver.cache.expert_bytes[layer])
            self.log["events"].append(("copy", self._start, layer, expert, nbytes, kind))

    def evicted(self, layer: int, expert: int) -> None:
        if self.log is not None:
            self.log["events"].append(("evict", self._start, layer, expert))

    def busy_within(self, start: float, end: float) -> float:
        """Seconds of [start, end] the link spends copying."""
        total = 0.0
        for a, b in reversed(self.busy):
            if b <= start:  # copies run in sequence: every older one ended earlier
                break
            total += max(0.0, min(b, end) - max(a, start))
        return total

    # The clock.
    def advance(self, now: float) -> None:
        """Start queued prefetches while the link is free before `now`."""
        while self.free_at < now:
            self._start = self.free_at
            if self.driver.pull(self.free_at) is None:
                self.free_at = now  # idle until now: later requests cannot start earlier
                return

    def fetch(self, layer: int, expert: int, now: float) -> bool:
        """An on-demand copy, starting once the link is free; False when no room is made."""
        self._start = max(self.free_at, now)
        return self.driver.admit(layer, expert, "fetch", self._start)


def _step_counts(window: np.ndarray, num_experts: int) -> np.ndarray:
    """Slot counts [L, N] of a pass's routing window [n, L, m]."""
    layers = window.shape[1]
    flat = window.astype(np.int64) + num_experts * np.arange(layers)[None, :, None]
    return np.bincount(flat.ravel(), minlength=layers * num_experts).reshape(layers, num_experts)


def simulate(trace, policy, profile: HardwareProfile, settings: SimulationSettings, rejected=None):
    """Replay `trace` through `policy` on `profile`; return a SimulationResult.

    rejected: [T, L, m] the target's routing of a real draft's proposal at each position of
    `trace` (routes rejected drafts; settings.rejected_routing becomes "trace")."""
    if rejected is not None:
        rejected = np.asarray(rejected, dtype=np.int64)
        if rejected.shape != np.shape(trace.expert_ids):
            raise ValueError(
                f"rejected routing has shape {rejected.shape}, "
                f"the trace {np.shape(trace.expert_ids)}"
            )
    elif settings.rejected_routing == "trace":
        raise ValueError("rejected routing 'trace' needs the draft's routing array")
    run = _Run(trace, policy, profile, settings, rejected)
    while run.emitted < settings.tokens and run.next_pass():
        pass
    return run.result()


class _Run:
    def __init__(self, trace, policy, profile, s: SimulationSettings, rejected=None):
        if not 0 <= s.fit_tokens < trace.num_tokens:
            raise ValueError(f"fit_tokens must leave tokens to replay (trace: {trace.num_tokens})")
        self.trace, self.policy, self.s = trace, policy, s
        self.costs = _Costs(trace, profile, s)
        total = trace.num_experts * int(np.sum(trace.expert_bytes))
        budget = expert_cache_budget(
            total, int(max(trace.expert_bytes)), ratio=s.cache_ratio, least_experts=0
        )
        self.cache = ExpertCache(trace.expert_bytes, trace.num_experts, budget)
        # The log (record=True): per-layer plans, and copies and evictions in the order done.
        self.log = {"layers": [], "events": []} if s.record else None
        self.link = _Link(self.costs, self.log)
        self.driver = self.link.driver = LayerDriver(self.cache, policy, self.link)
        self.k = s.draft_length if policy.speculative else 0
        self.driver.start(
            draft_length=self.k, top_k=trace.top_k, tier_overlap=self.costs.tier_overlap
        )
        self.rng = np.random.default_rng(s.seed)
        self.stop_rng = np.random.default_rng([s.seed, 2])  # the draft stops' draws
        self.accuracy = AccuracyMeter(trace.num_layers)
        # What a forecast must beat: "hot = active in the previous pass", on the same passes.
        self.previous_pass = AccuracyMeter(trace.num_layers)
        self.active = np.zeros((trace.num_layers, trace.num_experts), dtype=bool)  # [L, N]
        self.smape = SmapeMeter()
        self.pos, self.time, self.emitted, self.steps = s.fit_tokens, 0.0, 0, 0
        self.rejected = rejected
        self.pass_seconds = self.draft_seconds = 0.0  # the verification passes' layers, drafts
        self.drafted = 0
        self.popularity = None
        if rejected is None and s.rejected_routing == "popularity":
            self.popularity = _popularity(trace, s.fit_tokens)
            self.reject_rng = np.random.default_rng([s.seed, 1])

    def _doc_end(self) -> int:
        starts = self.trace.doc_starts
        return int(starts[np.searchsorted(starts, self.pos, side="right")])

    def next_pass(self) -> bool:
        if self.pos >= self.trace.num_tokens:
            return False
        drafts = self.rng.random(self.k) < self.s.acceptance  # drawn whatever n is: same steps
        accepted = int(np.argmin(drafts)) if not drafts.all() else self.k
        stops = self.stop_rng.random() < self.s.draft_stop  # drawn every step: same steps
        if self.s.accepted is not None:
            given = self.s.accepted
            accepted = min(given[self.steps], self.k) if self.steps < len(given) else self.k
        drafted = accepted + 1 if stops and accepted < self.k else self.k
        n = min(drafted + 1, self._doc_end() - self.pos)
        emitted = min(accepted + 1, n, self.s.tokens - self.emitted)
        counts = _step_counts(self._window(n, accepted), self.trace.num_experts)
        self.smape.update(counts)
        self.policy.begin_step(n)
        draft = (n - 1) * self.costs.draft_token
        self.policy.observe_draft(draft, n - 1)
        t = self.time + draft
        for layer in range(self.trace.num_layers):
            t = self._layer(layer, counts[layer], n, t)
        self.pass_seconds += t - self.time - draft
        self.draft_seconds += draft
        self.drafted += n - 1
        t += self.costs.step
        self.policy.end_step(emitted - 1)
        self.time, self.pos = t, self.pos + emitted
        self.emitted += emitted
        self.steps += 1
        return True

    def _window(self, n: int, accepted: int) -> np.ndarray:
        """Routing [n, L, m] of the pass: the trace up to the first rejected draft, then the
        rejected drafts' routing (see the module docstring)."""
        window = self.trace.expert_ids[self.pos : self.pos + n]
        first_rejected = accepted + 1  # pass token 0 is the last emitted token
        if first_rejected >= n or (self.rejected is None and self.popularity is None):
            return window
        window = np.array(window, dtype=np.int64)
        if self.rejected is not None:
            window[first_rejected:] = self.rejected[self.pos + first_rejected : self.pos + n]
        elif self.popularity is not None:
            window[first_rejected:] = self._draw(n - first_rejected, window.shape[2])
        return window

    def _draw(self, tokens: int, top_k: int) -> np.ndarray:
        """[tokens, L, m] slots from each layer's fit-split frequencies, distinct per token."""
        rng, p = self.reject_rng, self.popularity  # p: [L, N]
        out = np.empty((tokens, p.shape[0], top_k), dtype=np.int64)
        for layer in range(p.shape[0]):
            for t in range(tokens):
                out[t, layer] = rng.choice(p.shape[1], top_k, replace=False, p=p[layer])
        return out

    def _layer(self, layer: int, row: np.ndarray, n: int, start: float) -> float:
        policy, costs, link = self.policy, self.costs, self.link
        experts = np.flatnonzero(row)
        counts = row[experts]
        now = start + costs.dense + (n - 1) * costs.layer_token
        link.advance(now)
        link.layer_copy_seconds, link.layer_copies = 0.0, 0
        hot = policy.predicted_hot(layer)
        if hot is not None:
            self.accuracy.update(layer, hot, row)
        self.previous_pass.update(layer, self.active[layer], row)
        self.active[layer] = row > 0
        decided = time.thread_time()
        placed = self.driver.plan(layer, experts, counts, now, link.fetch)
        now += self._decision_time(decided)
        accelerator, cpu = placed.accelerator, placed.cpu
        cpu_busy = 0.0
        if len(cpu):
            cpu_busy = (
                costs.kernel_call
                + len(cpu) * costs.cpu_expert[layer]
                + row[cpu].sum() * costs.cpu_slot[layer]
                + costs.hidden_round_trip(n)
            )
            if costs.cpu_slowdown > 1.0:
                link.advance(now + cpu_busy)  # the copies that share host memory with it
                overlap = min(link.busy_within(now, now + cpu_busy) / cpu_busy, 1.0)
                cpu_busy += len(cpu) * costs.cpu_read[layer] * overlap * (costs.cpu_slowdown - 1)
        # await_all_copies: the CPU engine's order, its CPU tier inline, then the accelerator's
        # one call (so the tiers' turns are already in sequence); compute_while_reading: the
        # disk tier's, the experts in RAM, the CPU tier, then the arrivals (in sequence too);
        # else the tiers in parallel
        serial = costs.await_all_copies or costs.compute_while_reading
        if costs.compute_while_reading:
            acc_busy, acc_end, waited = self._on_arrival_time(
                layer, accelerator, row, now, cpu_busy
            )
        else:
            acc_start = now + cpu_busy if serial else now
            acc_busy, acc_end = self._accelerator_time(layer, accelerator, row, acc_start)
            called = costs.kernel_call if len(accelerator) else 0.0
            waited = max(acc_end - acc_start - acc_busy - called, 0.0)  # idle for arrivals
        self.driver.stats.copy_wait_seconds += waited
        end = max(acc_end, now + cpu_busy) + costs.bookkeeping
        if len(cpu) and len(accelerator):
            end += costs.split
        if costs.tier_overlap < 1.0:  # one processor for both tiers and the link: turns
            shared = 1.0 - costs.tier_overlap
            link.advance(end)
            copying = max(link.busy_within(now, end) - waited, 0.0)  # copies beside compute
            turns = 0.0 if serial else min(acc_end - now, cpu_busy)
            end += shared * (turns + costs.link_cpu_share * copying)
        link.advance(end)  # copies that start while the layer computes
        if self.log is not None:
            self.log["layers"].append(
                dict(
                    step=self.steps,
                    layer=layer,
                    start=now,
                    end=end,
                    needed=experts,
                    counts=counts,
                    accelerator=accelerator,
                    cpu=cpu,
                    fetch=placed.fetch,
                )
            )
        timing = LayerTiming(
            layer,
            end - now,
            cpu_busy,
            int(row[cpu].sum()),
            len(cpu),
            acc_busy,
            len(accelerator),
            link.layer_copy_seconds,
            link.layer_copies,
        )
        decided = time.thread_time()
        self.driver.finish(layer, experts, counts, placed, timing)
        return end + self._decision_time(decided)

    def _decision_time(self, since: float) -> float:
        """The CPU time of the policy and driver calls since `since` (this thread's: what other
        work on the host takes is left out), when the profile puts decisions on the clock
        (they run on the processor that computes, in this process)."""
        return time.thread_time() - since if self.costs.decisions_on_clock else 0.0

    def _accelerator_time(self, layer, accelerator, row, now) -> tuple[float, float]:
        costs = self.costs
        per_expert = costs.acc_expert[layer] + row[accelerator] * costs.acc_slot[layer]
        arrival = self.cache.ready_at[layer, accelerator]
        waiting = arrival > now
        end = now + per_expert[~waiting].sum() + (costs.kernel_call if len(accelerator) else 0.0)
        if costs.await_all_copies and waiting.any():  # one kernel call, after the last copy
            last = float(arrival[waiting].max())
            return float(per_expert.sum()), max(now, last) + costs.kernel_call + per_expert.sum()
        order = np.argsort(arrival[waiting], kind="stable")
        for a, t in zip(arrival[waiting][order], per_expert[waiting][order], strict=True):
            end = max(end, a) + t
        return float(per_expert.sum()), float(end)

    def _on_arrival_time(self, layer, accelerator, row, now, cpu_busy):
        """(kernel seconds, end, seconds idle for copies) of the accelerator experts computed
        on arrival after the CPU tier's `cpu_busy` (see the module docstring), `now` the
        router's output: the order of the disk tier's executor (`_compute_on_arrival`)."""
        costs = self.costs
        per_expert = costs.acc_expert[layer] + row[accelerator] * costs.acc_slot[layer]
        alone = costs.acc_expert[layer] + row[accelerator] * costs.acc_slot_alone[layer]
        arrival = self.cache.ready_at[layer, accelerator]
        waiting = arrival > now
        if not waiting.any():  # the engine's one pass: the CPU tier, then one call (every thread)
            called = costs.kernel_call if len(accelerator) else 0.0
            return float(alone.sum()), float(now + cpu_busy + called + alone.sum()), 0.0
        t = now
        if not waiting.all():  # the experts in RAM, on one thread while the misses are read
            t += costs.kernel_call + per_expert[~waiting].sum()
        t += cpu_busy
        order = np.argsort(arrival[waiting], kind="stable")  # the link's: copies in sequence
        arrivals, times = arrival[waiting][order], per_expert[waiting][order]
        last_times = alone[waiting][order]  # the call after the last arrival: every thread
        waited, first, busy = 0.0, 0, float(per_expert[~waiting].sum())
        while first < len(arrivals):  # the first awaited, with every one in by then: one call
            waited += max(float(arrivals[first]) - t, 0.0)
            t = max(t, float(arrivals[first]))
            last = int(np.searchsorted(arrivals, t, side="right"))
            group = (last_times if last == len(arrivals) else times)[first:last].sum()
            t += costs.kernel_call + group
            busy += float(group)
            first = last
        return busy, float(t), waited

    def result(self) -> "SimulationResult":
        self.driver.check_budget()
        return SimulationResult(
            policy=self.policy.name,
            tokens=self.emitted,
            steps=self.steps,
            seconds=self.time,
            stats=self.driver.stats,
            preload_bytes=self.driver.preload_bytes,
            peak_cache_bytes=self.cache.peak_bytes,
            budget_bytes=self.cache.budget_bytes,
            accuracy=self.accuracy.value(),
            smape=self.smape.value(),
            previous_pass_accuracy=self.previous_pass.value(),
            policy_stats=self.policy.stats(),
            log=self.log,
            pass_seconds=self.pass_seconds,
            draft_seconds=self.draft_seconds,
            num_layers=self.trace.num_layers,
            drafted_tokens=self.drafted,
        )


def _popularity(trace, fit_tokens: int) -> np.ndarray:
    """[L, N] expert frequencies of the fit split (the whole trace without one), each expert
    given one pseudo-count so that m distinct draws always exist."""
    ids = trace.expert_ids[:fit_tokens] if fit_tokens else trace.expert_ids
    counts = _step_counts(np.asarray(ids), trace.num_experts) + 1.0
    return counts / counts.sum(axis=1, keepdims=True)
