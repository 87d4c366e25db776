"""How many tokens to draft: a fixed K, or k*(a_hat) from the cost model on measured step times.

auto: the acceptance a_hat is a running estimate of the geometric rate (a Beta prior, updated
per observed draft position with exponential forgetting), and the step times V(k) = tau(k+1) +
h(k) come from a plan file or are measured online per pass size (running medians, linear
interpolation between measured pass sizes). k = best_draft_length(V, a_hat), seed 000 §3.3.

Speculation must not lose where it does not pay, so exploring costs a bounded budget: without a
plan only pass sizes 1 (plain steps, free) and 2 are measured before deciding, the far end
k_max + 1 only once k* >= 2 has been chosen on its own; and while k* = 0 a probe (one draft, or a
cheaper piece of evidence, see `moespec.decoding.speculation`) comes after `probe_interval`
plain steps, the gap doubling after every probe that leaves k* at 0, and never sooner than the
probe's own cost allows: a probe may cost EXPLORE_BUDGET of the plain decoding since the last
one, and HOPELESS_BUDGET once even an optimistic acceptance (the posterior mean plus OPTIMISM
deviations) gives k* = 0, that is, once the drafter's costs alone rule it out. On the demo
target a draft-model probe (a catch-up of 32 tokens) costs 2 ms, seven plain steps; at the
doubling gaps alone, probes took 25 ms of 757 ms over eight 256-token generations.
"""

import math
import statistics
from collections import defaultdict, deque
from typing import NamedTuple

from moespec.costmodel import expected_tokens

RETABLE = 0.05  # relative change of a running median that updates it (see RunningMedians.add)
RETABLE_SECONDS = 2e-6  # and absolute: lookup's h(k) of some 10 us moved by 2% every step
WARM_UP_TRIES = 4  # steps spent at most on measuring each warm-up pass size
STEADY_FEED = 2  # a draft pass feeding more tokens than this was catching up (not h(k))
# Exploring while k* = 0 costs at most these fractions of the plain decoding time between
# probes (DraftLengthPolicy.probe_due): a drafter that could pay at its optimistic
# acceptance, and one that could not (only drift in the costs or the text brings it back).
EXPLORE_BUDGET = 0.02
HOPELESS_BUDGET = 0.005
OPTIMISM = 2.0  # the optimistic acceptance: the posterior mean plus this many deviations


class RunningMedians:
    """Median of the last `window` samples per key, with linear interpolation between keys.

    The first sample of each key is dropped: a pass of a new size pays one-time costs (library
    kernels compiled for the shape) that would otherwise stand for its step time; it is kept
    aside for `provisional`. `version` grows whenever a median may have changed, so readers
    can cache what they derive.
    """

    def __init__(self, window: int = 16):
        self.samples = defaultdict(lambda: deque(maxlen=window))
        self.seen: set[int] = set()
        self.first: dict[int, float] = {}  # the dropped first sample of each key
        self.medians: dict[int, float] = {}
        self.version = 0
        self._curves, self._curves_version = {}, 0

    def add(self, key: int, value: float) -> None:
        if key not in self.seen:
            self.seen.add(key)
            self.first[key] = value
            return
        samples = self.samples[key]
        samples.append(value)
        median = statistics.median(samples)
        old = self.medians.get(key)
        # a median that moved by under RETABLE of itself (or RETABLE_SECONDS) keeps its
        # value: at a quarter of a millisecond a step, rebuilding every policy's tables on
        # each sample's noise cost more than a tenth of a plain step
        if old is None or abs(median - old) > max(RETABLE * old, RETABLE_SECONDS):
            self.medians = dict(sorted({**self.medians, key: median}.items()))
            self.version += 1

    def seed(self, medians: dict[int, float]) -> None:
        """Start from remembered medians (`moespec.decoding.remembered`): each counts as one
        sample of its key, so this run's own samples outvote it within a few steps; a seeded
        key's first sample is counted, not dropped (the seeded median outvotes its one-time
        costs)."""
        for key, value in medians.items():
            self.seen.add(key)
            self.samples[key].append(value)
        self.medians = dict(sorted({**self.medians, **medians}.items()))
        self.version += 1

    def curve(self, keys: range, anchor: tuple[int, float] | None = None) -> list:
        """[estimate(k, anchor) for k in keys], remembered until a median changes (the
        policies of several drafters read the same verify times every step)."""
        if self._curves_version != self.version:
            self._curves, self._curves_version = {}, self.version
        key = (keys.start, keys.stop, keys.step, anchor)
        if (values := self._curves.get(key)) is None:
            values = self._curves[key] = [self.estimate(k, anchor) for k in keys]
        return values

    def provisional(self, key: int) -> float | None:
        """While no median is known: key times the lowest value per key of the dropped first
        samples (a line through zero; an upper bound of sorts, as first samples run slow)."""
        rates = [value / k for k, value in self.first.items() if k > 0]
        if self.medians or not rates:
            return None
        return key * min(rates)

    def counted(self, key: int) -> int:
        """How many samples of `key` its median stands on (seeded ones included)."""
        return len(self.samples[key]) if key in self.samples else 0

    def known(self) -> dict[int, float]:
        """{key: median} for every key with a counted sample (do not modify)."""
        return self.medians

    def estimate(self, key: int, anchor: tuple[int, float] | None = None) -> float | None:
        """The median at `key`, else interpolated (or extrapolated) linearly from known keys.

        anchor: an extra known point (e.g. h(0) = 0) used only for interpolation.
        """
        points = self.medians
        if anchor is not None and anchor[0] not in points:
            points = {**points, anchor[0]: anchor[1]}
        if key in points:
            return points[key]
        keys = sorted(points)
        if len(keys) < 2:
            return None
        below = [k for k in keys if k < key]
        above = [k for k in keys if k > key]
        if below and above:
            lo, hi = below[-1], above[0]
        elif below:
            lo, hi = below[-2], below[-1]
        else:
            lo, hi = above[0], above[1]
        slope = (points[hi] - points[lo]) / (hi - lo)
        return max(points[lo] + slope * (key - lo), 0.0)


def _best_in_floats(table: list[float], acceptance: float) -> tuple[int, float]:
    """(k*, T_a(k*)) of a table of positive floats: `best_draft_length` and `throughput` of
    moespec.costmodel in the same float operations (G_k = G_(k-1) a + 1 is its Horner rule,
    ties keep the smaller k), without their input checks, which cost more than the choice
    itself once per step when a step takes a quarter of a millisecond."""
    gain, best_k, best = 1.0, 0, 1.0 / table[0]
    for k in range(1, len(table)):
        gain = gain * acceptance + 1
        value = gain / table[k]
        if value > best:
            best_k, best = k, value
    return best_k, best


def _best_with_survival(table: list[float], survival: list[float]) -> tuple[int, float]:
    """(k*, its throughput) when drafting k tokens emits 1 + S_1 + ... + S_k tokens on
    average (a proposal's own survival, `Draft.survival`): k up to the shorter of the table
    and the proposal, ties keeping the smaller k."""
    gain, best_k, best = 1.0, 0, 1.0 / table[0]
    for k in range(1, min(len(table), len(survival) + 1)):
        gain += survival[k - 1]
        value = gain / table[k]
        if value > best:
            best_k, best = k, value
    return best_k, best


class Plan(NamedTuple):
    """A policy's decision for the next step: draft `draft_length` tokens, expecting
    `throughput` tokens per second (T_a(k) = G_a(k)/V(k); None while V is unknown).
    probe: why the step is bought for measurement rather than because it pays: "warm-up"
    (a pass size not yet measured), "probe" (drafting again while k* = 0) or "neighbour"
    (k* - 1 or k* + 1); None for k* itself."""

    draft_length: int
    throughput: float | None
    probe: str | None = None


class DraftLengthPolicy:
    """`choose()` the next draft length; `observe(...)` each step's outcome.

    draft_length: an int (fixed) or "auto". max_draft_length: k_max for auto.
    step_times: V(0..k_max), complete step times given (tests, known tables).
    verify_times: tau(1..k_max+1) from a plan; the draft's h(k) is then measured online
    (falling back to `draft_times` from the plan until a draft length has been measured).
    Neither: both measured online.
    prior: (accepted, rejected) pseudo-counts of the Beta prior on the acceptance.
    forgetting: weight kept by past observations per observed draft position (1.0 = never).
    probe_interval: under auto, every this many steps at k* >= 1 run a neighbour of k* (k* - 1,
    then k* + 1) once, so the step times around the optimum stay measured; and after this many
    steps at k* = 0, probe (draft one token), the gap doubling up to max_probe_interval after
    each probe that leaves k* at 0, back to probe_interval once drafting pays.
    measured_verify: running medians of tau(n) shared with other drafters' policies (the
    target's pass time does not depend on who drafted); a new one when None.
    batch_verify_times: batch size -> the plan's tau_hat_B(k) of a pass of that many sequences
    (or None), read while `batch` > 1 in place of measured passes, as `verify_times` is at 1.
    """

    def __init__(
        self,
        draft_length: int | str = "auto",
        *,
        max_draft_length: int = 8,
        step_times: list[float] | None = None,
        verify_times: list[float] | None = None,
        draft_times: list[float] | None = None,
        prior: tuple[float, float] = (2.0, 2.0),
        forgetting: float = 0.98,
        probe_interval: int = 16,
        max_probe_interval: int = 256,
        window: int = 16,
        measured_verify: RunningMedians | None = None,
        batch_verify_times=None,
    ):
        if draft_length != "auto" and (not isinstance(draft_length, int) or draft_length < 0):
            raise ValueError(
                f"draft length must be 'auto' or an integer >= 0, got {draft_length!r}"
            )
        if max_draft_length < 0:
            raise ValueError(f"max draft length must be >= 0, got {max_draft_length}")
        if not 1 <= probe_interval <= max_probe_interval:
            raise ValueError(
                f"need 1 <= probe_interval <= max_probe_interval, got {probe_interval}, "
                f"{max_probe_interval}"
            )
        for name, table in (("step times", step_times), ("verify times", verify_times)):
            if table is not None:
                if len(table) < 1 or any(not v > 0 for v in table):
                    raise ValueError(f"{name} must be positive, the one-token pass first")
                max_draft_length = min(max_draft_length, len(table) - 1)
        self.fixed = None if draft_length == "auto" else draft_length
        self.max_draft_length = max_draft_length
        self.given_step_times = step_times
        self.plan_verify_times = verify_times
        self.plan_draft_times = draft_times
        # the plan's tau_hat_B(k) of a pass of B sequences (`moespec.plan.BatchTable.
        # verify_times`): batch size -> [k = 0..] or None where the plan has no row for it
        self.plan_batch_times = batch_verify_times
        self.accepted, self.rejected = prior
        self.forgetting = forgetting
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.verify_times = measured_verify or RunningMedians(window)  # by pass size n
        self.draft_times = RunningMedians(window)  # by draft length k
        self.steps = 0
        self.idle_streak = 0  # steps since this drafter last drafted or gave evidence
        self.probe_gap = probe_interval
        self.since_probe = 0
        self.probes = 0
        self.observations = 0  # draft positions seen (verified or scored)
        # h(k) before any draft time is measured: k draft steps of this share of tau(1) (the
        # draft's bytes over the target's, `Speculation.auto`); None: unknown, taken as free
        self.draft_byte_ratio: float | None = None
        self.probe_seconds: float | None = None  # what a probe cost, when it was not a draft
        # a drafter that proposes before every choice (`Speculation`'s cheap drafters): its
        # h(k) is spent whether it drafts or not, so V(k) = tau(k + 1) for its choice (the
        # choosing's own cost is bounded by the quiet gaps). Counting the suffix drafter's
        # 0.05-0.1 ms proposal in V(k) cost it 0.11x of its speedup over 12 demo prompts.
        self.proposes_first = False
        self.has_paid = False  # k* >= 2 chosen on the evidence: the far end is worth a step
        # sequences decoded together (moespec.decoding.batch): with B of them drafting alike,
        # a step's pass holds B (k + 1) tokens, and V(k) is this sequence's share of it,
        # tau(B (k + 1)) / B, so k*(a, B) falls as the batch's passes grow dearer
        self.batch = 1
        self.warm_tries = defaultdict(int)
        self._table_key = self._table = None
        self._idle = None  # (what it depends on, the idle streak it holds below, the plan)

    @property
    def acceptance_estimate(self) -> float:
        """Posterior mean of the geometric acceptance rate."""
        return self.accepted / (self.accepted + self.rejected)

    @property
    def optimistic_acceptance(self) -> float:
        """The posterior mean plus OPTIMISM standard deviations of the Beta posterior (a normal
        reading of its upper tail), below 1: the acceptance a probe could still reveal."""
        a, b = self.accepted, self.rejected
        deviation = (a * b / ((a + b) ** 2 * (a + b + 1))) ** 0.5
        return min(self.acceptance_estimate + OPTIMISM * deviation, 0.999)

    def step_times(self) -> list[float] | None:
        """V(0..k_max): given, or tau from the plan and h measured, or both measured (None
        until two pass sizes are measured). Cached until a median changes."""
        if self.given_step_times is not None:
            return list(self.given_step_times[: self.max_draft_length + 1])
        key = (self.verify_times.version, self.draft_times.version, self.batch)
        if key != self._table_key:
            self._table_key, self._table = key, self._build_table()
        return self._table

    def _build_table(self) -> list[float] | None:
        table = []
        measured = self.draft_times.known()
        k_max = self.max_draft_length
        batch = self.batch
        if batch > 1:  # this sequence's share of a pass of batch * (k + 1) tokens
            shared = self.verify_times.curve(range(batch, batch * (k_max + 1) + 1, batch))
            planned = self.plan_batch_times(batch) if self.plan_batch_times else None
            if planned is not None:  # the plan's where it has them, as tau(n) is at B = 1
                shared = [*planned[: k_max + 1], *shared[len(planned) :]]
            verifies = [None if v is None else v / batch for v in shared]
        elif self.plan_verify_times is None:
            verifies = self.verify_times.curve(range(1, k_max + 2))
        else:
            verifies = self.plan_verify_times
        drafts = self.draft_times.curve(range(k_max + 1), anchor=(0, 0.0))
        floor = 0.0
        for k in range(k_max + 1):
            verify = verifies[k]
            if self.proposes_first:
                draft = 0.0  # spent before the choice, whatever it chooses: a sunk cost
            elif k in measured:
                draft = measured[k]
            elif self.plan_draft_times is not None and k < len(self.plan_draft_times):
                draft = self.plan_draft_times[k]
            elif drafts[k] is not None:
                draft = drafts[k]
            else:  # nothing measured yet: a drafter that drafts rarely (a model between
                # plain steps) would otherwise go long on an h(k) of zero, as if free
                draft = self.draft_times.provisional(k)
                if draft is None and self.draft_byte_ratio is not None and verifies[0]:
                    draft = k * self.draft_byte_ratio * verifies[0]  # bytes over bytes
                draft = draft or 0.0
            if verify is None:
                return None
            # a pass of more tokens is never cheaper: noise between two measured sizes
            # must not extrapolate to a falling (or vanishing) verify time
            verify = max(verify, floor)
            floor = verify
            # ... nor dearer than as many one-token passes (which do the same work): one slow
            # sample of a size (a page fault, another process) made it look so costly that it
            # was never drafted, so never measured again, and remembered so across runs
            if k and verifies[0]:
                verify = min(verify, (k + 1) * verifies[0])
            table.append(max(verify + draft, 1e-9))
        return table

    def plan(self, limit: int | None = None, survival: list[float] | None = None) -> Plan:
        """The next step's draft length (at most `limit`) and the throughput T_a(k*) that
        the choice among drafters compares; `choose()` is this plus `commit`.

        survival: S_1..S_k of this step's proposal (`Draft.survival`), the chance that its
        first j tokens are all accepted, where the drafter counts one; the expected tokens of
        k drafts are then 1 + S_1 + ... + S_k instead of G_a(k), and no probe is bought (such a
        drafter proposes every step and is scored whether it drafts or not)."""
        k_max = self.max_draft_length if limit is None else min(self.max_draft_length, limit)
        if survival is None and self._idle is not None:  # k* = 0 until something changes
            key, due, plan = self._idle
            if self.idle_streak < due and key == self._idle_key(k_max):
                return plan
        table = self.step_times()
        if self.fixed is not None:
            k = min(self.fixed, k_max) if limit is not None else self.fixed
            return Plan(k, self._throughput(table, k, survival))
        if k_max == 0:
            return Plan(0, self._throughput(table, 0))
        if self.plan_verify_times is None and self.given_step_times is None:
            # a drafter with its own survival grows its drafts one pass size at a time (below)
            # and needs no far end measured first
            warm = self._warm_up(k_max, far=survival is None)
            if warm is not None:
                return Plan(warm, self._throughput(table, warm, survival), "warm-up")
        if table is None:
            return Plan(0, None)
        table = table[: k_max + 1]
        if survival is not None:
            # no longer than one token past the longest pass measured: a pass size not yet
            # measured is extrapolated from those that were, which a long draft on a likely
            # match would otherwise trust (each step can go one further)
            online = self.plan_verify_times is None and self.given_step_times is None
            measured = max(self.verify_times.known(), default=1) if online else len(table)
            return Plan(*_best_with_survival(table[: measured + 1], survival))
        best, value = _best_in_floats(table, min(self.acceptance_estimate, 0.999))
        if best == 0:
            if self.probe_due(table):
                return Plan(1, value, "probe")
            # the same plan until the costs, the evidence or the probe schedule change, or
            # the plain steps earn a probe: a drafter that cannot pay (the demo's draft
            # model) cost 15-20 us a choice to plan again, a tenth of what choosing costs
            plan = Plan(0, value)
            self._idle = self._idle_key(k_max), self._probe_due_at(table), plan
            return plan
        if self.since_probe + 1 >= self.probe_interval:
            neighbour = best - 1 if self.probes % 2 == 0 else best + 1
            return Plan(min(max(neighbour, 0), k_max), value, "neighbour")
        return Plan(best, value)

    def probe_due(self, table: list[float]) -> bool:
        """While k* = 0: whether the plain steps since the last evidence earn a probe. The gap
        is `probe_gap` (doubling) steps, and at least the probe's cost over the budget's share
        of a plain step: EXPLORE_BUDGET, or HOPELESS_BUDGET when even the optimistic
        acceptance gives k* = 0. A probe costs `probe_seconds` when it is not a draft (a
        greedy catch-up, `observe_probe`), else a one-token draft step over a plain one."""
        if self.idle_streak < self.probe_gap:
            return False
        cost = self.probe_seconds
        if cost is None and len(table) > 1:
            cost = table[1] - table[0]
        if not cost or cost <= 0:
            return True
        budget = HOPELESS_BUDGET if self.hopeless(table) else EXPLORE_BUDGET
        return self.idle_streak * table[0] * budget >= cost

    def _idle_key(self, k_max: int) -> tuple:
        """What a plan of k* = 0 depends on, but for the plain steps since the last probe."""
        return (
            self.verify_times.version,
            self.draft_times.version,
            k_max,
            self.accepted,
            self.rejected,
            self.probe_gap,
            self.probe_seconds,
        )

    def _probe_due_at(self, table: list[float]) -> float:
        """The plain steps since the last evidence at which `probe_due` turns true."""
        cost = self.probe_seconds
        if cost is None and len(table) > 1:
            cost = table[1] - table[0]
        if not cost or cost <= 0:
            return self.probe_gap
        budget = HOPELESS_BUDGET if self.hopeless(table) else EXPLORE_BUDGET
        return max(self.probe_gap, math.ceil(cost / (table[0] * budget)))

    def hopeless(self, table: list[float]) -> bool:
        """Whether k* = 0 even at the optimistic acceptance: the costs alone rule drafting out."""
        return _best_in_floats(table, self.optimistic_acceptance)[0] == 0

    def choose(self, limit: int | None = None) -> int:
        """plan(limit).draft_length, counting the probe it may be."""
        plan = self.plan(limit)
        self.commit(plan)
        return plan.draft_length

    def commit(self, plan: Plan) -> None:
        """Count a plan that will run: probes move the probe schedule."""
        if self.fixed is not None:
            return
        if plan.probe == "warm-up":
            self.warm_tries[plan.draft_length] += 1
        elif plan.probe == "probe":  # out of k* = 0: the next one waits twice as long
            self.idle_streak = 0
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_interval)
        elif plan.probe == "neighbour":
            self.since_probe = 0
            self.probes += 1
        elif plan.probe is None and plan.draft_length > 0:  # drafting pays on the evidence
            self.since_probe += 1
            self.probe_gap = self.probe_interval
            self.has_paid |= plan.draft_length >= 2

    def _throughput(self, table, k: int, survival: list[float] | None = None) -> float | None:
        if table is None or k >= len(table):
            return None
        if survival is not None:
            return (1.0 + sum(survival[:k])) / table[k]
        return float(expected_tokens(min(self.acceptance_estimate, 0.999), k)) / table[k]

    def _warm_up(self, k_max: int, far: bool = True) -> int | None:
        """Pass sizes measured before trusting interpolation, a few tries each (a drafter may
        propose fewer tokens than asked): 1 and 2 first; k_max + 1 once k* >= 2 has been
        chosen on the evidence (until then, linear extrapolation from 1 and 2, which
        overestimates a deduplicating pass, errs towards drafting less)."""
        known = self.verify_times.known()
        ends = (0, 1, k_max) if self.has_paid and far else (0, 1)
        for k in dict.fromkeys(ends):
            if k + 1 not in known and self.warm_tries[k] < WARM_UP_TRIES:
                return k
        return None

    def observe(
        self,
        draft_length: int,
        drafted: int,
        accepted: int,
        verify_seconds: float,
        draft_seconds: float,
        *,
        catch_up: int = 0,
        catch_up_seconds: float = 0.0,
    ) -> None:
        """Record a step: `drafted` tokens proposed (<= draft_length), `accepted` of them;
        catch_up: tokens the draft pass fed beyond a steady step's, in catch_up_seconds (see
        `observe_draft`)."""
        self.verify_times.add(drafted + 1, verify_seconds)
        self.observe_draft(
            drafted, accepted, draft_seconds, catch_up=catch_up, catch_up_seconds=catch_up_seconds
        )

    def observe_draft(
        self,
        drafted: int,
        accepted: int,
        draft_seconds: float,
        *,
        catch_up: int = 0,
        catch_up_seconds: float = 0.0,
    ) -> None:
        """The drafter's part of `observe` (the verify time recorded elsewhere).

        h(k) is a steady step's draft time, whose feed is the STEADY_FEED tokens the last
        verification emitted. A step that caught up on more (after steps it did not draft)
        counts as the steady step it contains: its drafting, plus its feed's time scaled to
        STEADY_FEED tokens. Without this a drafter that only ever ran after plain steps never
        had h(k) measured, and an unmeasured h(k) counts as free."""
        self.steps += 1
        if not drafted:
            self.idle_streak += 1
            return
        self.idle_streak = 0
        if catch_up <= STEADY_FEED:
            self.draft_times.add(drafted, draft_seconds)
        elif catch_up_seconds > 0:
            fed = catch_up + STEADY_FEED
            steady = draft_seconds - catch_up_seconds + catch_up_seconds * STEADY_FEED / fed
            self.draft_times.add(drafted, steady)
        # Geometric acceptance: `accepted` successes, then one failure unless all passed.
        self.observe_agreement(accepted, 1 if accepted < drafted else 0)

    def observe_agreement(self, agreed: int, disagreed: int) -> None:
        """Evidence on the acceptance from positions the drafter was not verified at: its
        proposal against the tokens the target emitted (successes, failures)."""
        observed = agreed + disagreed
        if not observed:
            return
        self.observations += observed
        self.idle_streak = 0
        keep = self.forgetting**observed
        self.accepted = self.accepted * keep + agreed
        self.rejected = self.rejected * keep + disagreed

    def observe_probe(self, seconds: float, one_token_seconds: float | None = None) -> None:
        """A probe that was not a draft step took `seconds` (the price of the next one);
        one_token_seconds: a one-token draft pass timed with it, a sample of h(1)."""
        self.probe_seconds = seconds
        if one_token_seconds is not None:
            self.draft_times.add(1, one_token_seconds)

    def observe_idle(self) -> None:
        """A plain step the drafter could have drafted in."""
        self.steps += 1
        self.idle_streak += 1
