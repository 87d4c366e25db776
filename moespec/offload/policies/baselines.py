"""Baseline offload policies, under the same cache budget and interface as SpAc.

- `LRUPolicy`: on-demand loading with a least-recently-used cache per layer (Mixtral-offloading
  style): every expert a pass needs runs on the accelerator; a miss is copied now and the layer
  waits for it; the victim is the least recently used expert of the same layer (of the layer
  holding most experts when none of its own can leave). One global LRU order would thrash:
  layers are visited cyclically, and a pass over all of them needs more experts than a 25%
  cache holds, so every expert would be evicted just before its layer came round again.
  When nothing can leave the cache (all in use: a budget below one layer's needs), the expert
  runs on the CPU instead, and the simulator counts it.
- `StaticPolicy`: the most frequent experts of the fit split placed once (Fiddler style), every
  other expert computed on the CPU; nothing moves at run time.
- `LayerStaticPolicy` (`static-layers`, llama.cpp's reading): whole layers' experts placed once.
  llama.cpp keeps the experts of a layer in one tensor per projection, so `--n-cpu-moe N` (or an
  `-ot` pattern over `ffn_*_exps`) places experts a layer at a time: the experts of the first
  N MoE layers stay in host memory and run on the CPU, those of the rest on the accelerator.
  Under a budget the accelerator holds the last layers whose experts fit whole; its hit rate
  is the fraction of layers placed, whatever the routing. Seed 003's llama.cpp baselines run
  this way (its authors' release starts from `-ot "\\.ffn_(up|down|gate)_exps"=CPU`).
- `HybridPolicy` (HybriMoE-like, our reading of Zhong et al. 2025 from seed 003 App. I.3): a
  score-based cache (score = exponentially decayed slot count, lowest score evicted); per layer
  a greedy CPU/accelerator split over the misses, hottest first, each to the side that finishes
  the layer sooner by the learned unit times; and a next-layer prefetch of the top_k
  highest-scored experts of layer l + 1 not cached, issued when layer l's routing is known.
"""

from collections import OrderedDict, deque

import numpy as np

from moespec.offload.policies.base import EMPTY, LayerPlan, OffloadPolicy


class LRUPolicy(OffloadPolicy):
    name = "lru"

    def reset(self, cache, *, draft_length: int, top_k: int) -> None:
        # Per layer: expert -> None, least recently used first; and how many each holds.
        self._order = [OrderedDict() for _ in range(cache.num_layers)]
        self._held = [0] * cache.num_layers
        super().reset(cache, draft_length=draft_length, top_k=top_k)

    def admitted(self, layer: int, expert: int) -> None:
        order = self._order[layer]
        self._held[layer] += expert not in order
        order[expert] = None

    def plan_layer(self, layer, experts, counts, now) -> LayerPlan:
        cached = self.cache.present[layer, experts]
        order = self._order[layer]
        for e in experts[cached].tolist():
            order.move_to_end(e)
        return LayerPlan(accelerator=experts, cpu=EMPTY, fetch=experts[~cached])

    def choose_victim(self, layer, expert, now):
        victim = self._victim_in(layer, now)
        if victim is not None:
            return victim
        # The other layers, fullest first (ties: lower layer); `layer` has none to give. The
        # fullest mostly has one: look there before ordering them all.
        held = self._held
        fullest = max(range(len(held)), key=held.__getitem__)  # the first of the fullest
        if fullest != layer and (victim := self._victim_in(fullest, now)):
            return victim
        for victim_layer in sorted(range(len(held)), key=held.__getitem__, reverse=True):
            if victim_layer not in (layer, fullest) and (
                victim := self._victim_in(victim_layer, now)
            ):
                return victim
        return None

    def _victim_in(self, layer: int, now: float) -> tuple[int, int] | None:
        """The least recently used expert of `layer` that can leave now (cache.evictable),
        taken out of the order; None when none can."""
        order = self._order[layer]
        if not order:
            return None
        cache = self.cache
        first = next(iter(order))  # most often the victim: one scalar check
        if cache.evictable(layer, first, now):
            victim = first
        else:  # the layer's experts that can leave, at once; then the first of them in order
            can = cache.ready_at[layer] <= now
            can &= cache.present[layer]
            can &= ~cache.pinned[layer]
            if not can.any():
                return None
            can = can.tolist()
            victim = next((e for e in order if can[e]), None)
            if victim is None:
                return None
        del order[victim]
        self._held[layer] -= 1
        return layer, victim


class StaticPolicy(OffloadPolicy):
    name = "static"

    def reset(self, cache, *, draft_length: int, top_k: int) -> None:
        if getattr(self, "frequencies_", None) is None:
            raise ValueError("static placement needs fit(trace) first (the frequencies to place)")
        super().reset(cache, draft_length=draft_length, top_k=top_k)

    def plan_layer(self, layer, experts, counts, now) -> LayerPlan:
        cached = self.cache.present[layer, experts]
        return LayerPlan(accelerator=experts[cached], cpu=experts[~cached], fetch=EMPTY)


class LayerStaticPolicy(StaticPolicy):
    name = "static-layers"

    def preload(self, frequencies: np.ndarray) -> list[tuple[int, int]]:
        """All experts of the last layers whose experts fit whole (`--n-cpu-moe`); routing
        frequencies play no part, as in llama.cpp."""
        cache, loaded = self.cache, []
        for layer in reversed(range(cache.num_layers)):
            if cache.num_experts * int(cache.expert_bytes[layer]) > cache.free_bytes:
                break
            for expert in range(cache.num_experts):
                cache.insert(layer, expert, ready_at=-np.inf)
                self.admitted(layer, expert)
                loaded.append((layer, expert))
        return loaded


class HybridPolicy(OffloadPolicy):
    name = "hybrid"

    def __init__(self, decay: float = 0.8):
        if not 0 <= decay < 1:
            raise ValueError(f"score decay must be in [0, 1), got {decay}")
        self.decay = decay

    def reset(self, cache, *, draft_length: int, top_k: int) -> None:
        self.scores = np.zeros((cache.num_layers, cache.num_experts))  # [L, N]
        self._queue = deque()
        super().reset(cache, draft_length=draft_length, top_k=top_k)

    def plan_layer(self, layer, experts, counts, now) -> LayerPlan:
        self._queue.clear()  # this layer's prefetches not started: the greedy decides them
        cached = self.cache.present[layer][experts]
        missed = ~cached
        absent, absent_counts = experts[missed], counts[missed]
        hot = absent[np.argsort(-absent_counts)]
        taken = self._greedy_fetch(len(experts) - len(absent), hot)  # positions in `hot`
        fetch = hot[taken] if taken else EMPTY
        if taken:  # the rest of the misses, in increasing id (as np.setdiff1d gives them)
            left = np.ones(len(hot), dtype=bool)
            left[taken] = False
            on_cpu = np.sort(hot[left])
        else:
            on_cpu = np.sort(absent)
        self._prefetch_next(layer)
        return LayerPlan(
            accelerator=np.concatenate([experts[cached], fetch]), cpu=on_cpu, fetch=fetch
        )

    def _greedy_fetch(self, cached: int, absent_hot_first: np.ndarray) -> list[int]:
        """The positions in `absent_hot_first` of the misses to copy, in order."""
        t = self.unit_times
        gpu, cpu, io = t.accelerator_per_expert, t.cpu_per_expert, t.copy_per_expert
        if gpu is None or cpu is None or io is None:
            return []  # nothing learned yet: misses run on the CPU
        gpu_end, cpu_end, link_end, fetched = cached * gpu, 0.0, 0.0, []
        for j in range(len(absent_hot_first)):
            via_link = max(max(gpu_end, link_end + io) + gpu, cpu_end)
            via_cpu = max(gpu_end, cpu_end + cpu)
            if via_link < via_cpu:
                link_end += io
                gpu_end = max(gpu_end, link_end) + gpu
                fetched.append(j)
            else:
                cpu_end += cpu
        return fetched

    def _prefetch_next(self, layer: int) -> None:
        nxt = (layer + 1) % self.cache.num_layers
        candidates = np.flatnonzero(~self.cache.present[nxt] & (self.scores[nxt] > 0))
        best = candidates[np.argsort(-self.scores[nxt, candidates], kind="stable")]
        self._queue.extend((nxt, int(e)) for e in best[: self.top_k])

    def end_layer(self, layer, experts, counts) -> None:
        self.scores[layer] *= self.decay
        self.scores[layer, experts] += counts

    def has_prefetch(self) -> bool:
        return bool(self._queue)

    def next_prefetch(self):
        while self._queue:
            item = self._queue.popleft()
            if not self.cache.present[item]:
                return item
        return None

    def choose_victim(self, layer, expert, now):
        c = self.cache
        can_leave = c.ready_at <= now
        can_leave &= c.present
        can_leave &= ~c.pinned
        score = np.where(can_leave, self.scores, np.inf)
        flat = int(score.argmin())
        if score.flat[flat] == np.inf:  # nothing can leave (scores are finite)
            return None
        return divmod(flat, c.num_experts)

    def predicted_hot(self, layer: int) -> np.ndarray:
        return self.scores[layer] >= 1  # a decayed count of at least one slot
