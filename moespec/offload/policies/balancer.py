"""The Heterogeneous Workload Balancer of MoE-SpAc (seed 003 §3.3, App. C).

Per layer and step, the integer threshold tau in 1..K that splits experts into hot (utility
>= tau: kept on or prefetched to the accelerator) and cold (computed on the CPU):

    min_tau |T_cpu(tau) - T_gpu(tau)|
        T_cpu(tau) = r_c(tau) * n * m * T^u_cpu        (r_c: share of the pass's slots on CPU)
        T_gpu(tau) = r_g(tau) * b * T^u_gpu            (r_g: share of its b distinct experts on GPU)
    s.t. T^u_io * n(tau) <= T_layer + gamma * T^u_draft / L      (I/O, eq. 10)
         W_e * n(tau)     <= VRAM left(tau)                      (memory, eq. 11)
         0 < tau <= K, integer                                    (eq. 12)

n(tau) is the number of experts of the layer with utility >= tau not on the accelerator (the
prefetches tau asks for). VRAM left(tau) is our reading of "remaining VRAM": the free bytes plus
the bytes of cached experts, of any layer, whose utility is below tau (the evictor may drop
them for a hotter expert). r_c, r_g and b are learned per layer from the passes seen (App. C.1
learns them in a warm-up; from a cold start the utilities of the first steps have not yet
spread above 1, so we keep averaging after it), and the unit times from the caller's timings;
the balancer starts choosing after `warmup_steps` steps. With K <= 8 values, the
problem is solved exactly by enumeration; when no tau meets both constraints, the least
violating one is taken (fewest experts beyond the tighter constraint), and the choice says so.

Beyond the paper, for tiers that share one processor (`serial` s > 0: the share of the shorter
tier's work not hidden under the longer one, 1 - the measured tier overlap; the CPU engine's
tiers run one after the other and its link thread takes the same cores): the objective is the
layer's time, max(T_cpu, T_gpu) + s min(T_cpu, T_gpu) + s n(tau) T^u_io (the copies on the
compute's cores) + s T_split where both tiers have work (the measured cost of splitting a
layer: its gather, scatter and second call), and tau = K + 1 is a candidate too: nothing hot,
nothing prefetched, the whole layer on the CPU in one call (SpAc's plan then leaves even its
cached experts to the CPU). With s = 0 (a device of its own) the objective and the candidates
are the paper's. On the CPU engine, where a copy or a cached expert makes no expert faster to
compute, this keeps SpAc from copying what it cannot win back and from splitting a layer that
one call computes sooner.
"""

from dataclasses import dataclass
from itertools import accumulate

import numpy as np


@dataclass(frozen=True)
class ThresholdChoice:
    tau: int
    feasible: bool
    violation: float  # experts beyond the tighter of the I/O and memory capacities (0: feasible)
    objective: float  # |T_cpu - T_gpu| at tau (serial tiers: the layer's time, see the module)


def solve_threshold(
    prefetch_counts,
    io_capacity: float,
    memory_capacity,
    cpu_times,
    gpu_times,
    *,
    serial: float = 0.0,
    copy_seconds: float = 0.0,
    split_seconds: float = 0.0,
    all_cpu_seconds: float | None = None,
) -> ThresholdChoice:
    """Exact solution by enumeration; every array is indexed by tau - 1 for tau = 1..K.

    prefetch_counts: n(tau); io_capacity: experts the link moves in the window;
    memory_capacity: experts that fit in VRAM left(tau); cpu/gpu_times: T_cpu(tau), T_gpu(tau).
    Order: least violation, then the least objective, then the smallest tau. The objective is
    |T_cpu - T_gpu|; with `serial` s > 0, the layer's time max + s min + s n(tau) copy_seconds
    (+ s split_seconds where T_cpu and T_gpu are both above 0), and tau = K + 1 (nothing
    prefetched; T_cpu = `all_cpu_seconds`, T_gpu = 0) a candidate.
    """
    candidates = list(zip(prefetch_counts, memory_capacity, cpu_times, gpu_times, strict=True))
    if serial > 0 and candidates and all_cpu_seconds is not None:
        candidates.append((0.0, float("inf"), float(all_cpu_seconds), 0.0))
    best = None
    for i, (count, memory, cpu, gpu) in enumerate(candidates):
        violation = max(0.0, float(count) - float(min(io_capacity, memory)))
        if serial > 0:
            split = split_seconds if cpu > 0 and gpu > 0 else 0.0
            objective = max(cpu, gpu) + serial * (min(cpu, gpu) + count * copy_seconds + split)
        else:
            objective = abs(cpu - gpu)
        key = (violation, objective, i + 1)
        if best is None or key < best:
            best = key
    if best is None:
        raise ValueError("solve_threshold needs at least one candidate tau (K >= 1)")
    violation, objective, tau = best
    return ThresholdChoice(
        tau=tau, feasible=violation == 0, violation=violation, objective=objective
    )


class WorkloadBalancer:
    """Warm-up statistics per layer and the per-layer choice of tau."""

    def __init__(self, num_layers: int, max_utility: int, warmup_steps: int = 8):
        self.max_utility = max_utility
        self.warmup_steps = warmup_steps
        # Per utility level v = 0..K, summed over passes: the share of a pass's slots and of its
        # distinct experts at v. r_c(tau) and r_g(tau) are their cumulative sums (taken in
        # `choose`, not at every pass: the sum of cumulative sums is the cumulative sum).
        self.slot_share = np.zeros((num_layers, max_utility + 1))  # [L, K + 1]
        self.expert_share = np.zeros((num_layers, max_utility + 1))  # [L, K + 1]
        self.distinct = np.zeros(num_layers)  # sum of b
        self.passes = np.zeros(num_layers)
        self.infeasible = 0
        self.none_hot = 0
        self.choices = 0
        self.tau_sum = 0

    def record(self, layer: int, utilities: np.ndarray, counts: np.ndarray) -> None:
        """One pass's needed experts at `layer`: their utilities (before the update) and counts."""
        # Per utility level v = 0..K: the slots and the experts at v (utilities are 0..K).
        levels, b = self.max_utility + 1, len(counts)
        self.slot_share[layer] += np.bincount(
            utilities, weights=counts / counts.sum(), minlength=levels
        )
        self.expert_share[layer] += np.bincount(utilities, minlength=levels) / b
        self.distinct[layer] += b
        self.passes[layer] += 1

    def shares(self, layer: int) -> tuple[list, list]:
        """(r_c(tau), r_g(tau)) for tau = 1..K, averaged over the passes recorded: the share of
        a pass's slots at utility below tau, and of its distinct experts at or above. (Plain
        lists: K + 1 values, where numpy's cost per call is most of the time.)"""
        passes = max(float(self.passes[layer]), 1.0)
        slots = accumulate(self.slot_share[layer, :-1].tolist())
        experts = accumulate(self.expert_share[layer, :-1].tolist())
        return [s / passes for s in slots], [1.0 - e / passes for e in experts]

    def choose(
        self,
        layer: int,
        *,
        prefetch_counts: np.ndarray,
        memory_capacity: np.ndarray,
        io_capacity: float,
        slots: int,
        cpu_per_slot: float,
        gpu_per_expert: float,
        serial: float = 0.0,
        copy_seconds: float = 0.0,
        split_seconds: float = 0.0,
    ) -> ThresholdChoice:
        """tau for `layer` (module docstring); `serial`, `copy_seconds`, `split_seconds`: tiers
        on one processor, and the time of a copy and of splitting a layer there."""
        r_c, r_g = self.shares(layer)
        cpu_unit = slots * cpu_per_slot
        gpu_unit = (
            float(self.distinct[layer]) / max(float(self.passes[layer]), 1.0) * gpu_per_expert
        )
        cpu = [r * cpu_unit for r in r_c]
        gpu = [r * gpu_unit for r in r_g]
        choice = solve_threshold(
            prefetch_counts,
            io_capacity,
            memory_capacity,
            cpu,
            gpu,
            serial=serial,
            copy_seconds=copy_seconds,
            split_seconds=split_seconds,
            all_cpu_seconds=slots * cpu_per_slot,
        )
        self.choices += 1
        self.tau_sum += choice.tau
        self.infeasible += not choice.feasible
        self.none_hot += choice.tau > self.max_utility  # tau = K + 1 (serial tiers only)
        return choice


def link_fetches(
    cpu_seconds,
    *,
    link_backlog: float,
    copy_seconds: float,
    accelerator_seconds: float,
) -> int:
    """Beyond the paper: the link as a third resource. How many of a layer's misses, taken in
    the order given (hottest first), to copy on demand instead of computing on the CPU.

    The CPU computes the misses left to it in sequence (`cpu_seconds` [b], each one's time);
    the link, busy for `link_backlog` seconds already, copies one expert per `copy_seconds`,
    and the accelerator computes the copied ones in `accelerator_seconds` each, after the last
    arrives. Fetching the first j finishes the misses at

        finish(j) = max( sum_{i >= j} cpu_i ,  link_backlog + j (copy + accelerator) )   (j > 0)

    and j = argmin finish(j), the smallest on ties (0: the paper's CPU fallback for every miss;
    seed 003's balancer weighs the CPU against the accelerator only, eq. 7-12).
    """
    cpu = np.asarray(cpu_seconds, dtype=float)
    left = np.concatenate([np.cumsum(cpu[::-1])[::-1], [0.0]])  # [b + 1]: CPU time of i >= j
    j = np.arange(len(left))
    link = np.where(j > 0, link_backlog + j * (copy_seconds + accelerator_seconds), 0.0)
    return int(np.argmin(np.maximum(left, link)))
