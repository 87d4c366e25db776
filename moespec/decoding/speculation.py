"""Per step, which drafter drafts and how many tokens, or none: the choice of `--draft auto`.

Every drafter d has its own acceptance estimate a_d and draft cost h_d(k); the target's verify
time tau(n) is one table for all of them (a pass of n tokens costs the same whoever drafted
it). Each step runs the option of highest expected throughput T = G_{a_d}(k*_d) / V_d(k*_d),
V_d(k) = tau(k + 1) + h_d(k) (seed 000 §1, §3.3, each drafter through the same cost model);
k = 0 (a plain step, T = 1/tau(1)) is always an option and costs nothing beyond the plain
step: a drafter that does not draft is not run.

Evidence comes as cheaply as it can:
- cheap drafters (the suffix drafter, prompt lookup) propose before the choice; when another
  option runs, their proposal is scored against the tokens the target emitted (successes up to
  the first mismatch, then one failure), an unbiased estimate of their acceptance under greedy
  decoding and under sampling alike (a point-mass draft x is accepted with probability p(x),
  the chance that the emitted token is x);
- a model drafter at k* = 0 is probed, under greedy decoding, by catching up on the tokens it
  missed in one batched pass (at most its last 32: `ModelDrafter.max_catch_up`) and
  scoring its greedy predictions at those positions, not by a speculative step, then timing
  one one-token draft pass (a sample of h(1)); under sampling a probe is a one-token draft.
  The probe gap doubles after every probe that leaves k* = 0, and a probe costs at most a
  small share of the plain decoding between probes (`DraftLengthPolicy.probe_due`); only
  plain steps count towards it: while another drafter drafts, a probe would cost a step
  that already pays;
- a greedy model drafter's first look is such a probe, over the context's last FIRST_LOOK
  tokens (not the whole prompt), before it drafts at all: its acceptance and h(1) then
  decide whether it is worth a speculative step (on the demo pair the look costs 1.3 ms, a
  first speculative step with the prompt's catch-up 3 ms, and 15 positions already show
  that the draft cannot pay). The look and the draft's warm-up steps (pass sizes not yet
  measured) wait while a cheap drafter can measure them, for at most WARM_UP_WAIT choices:
  a pass of n tokens costs the same whoever drafted it. When the draft's bytes alone rule it
  out (`DraftLengthPolicy.draft_byte_ratio`: h(k) estimated as k steps of tau(1) times the
  draft's bytes per token over the target's), the look is priced as a hopeless probe.
"""

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from moespec.decoding.draft_policy import (
    HOPELESS_BUDGET,
    DraftLengthPolicy,
    Plan,
    RunningMedians,
)
from moespec.decoding.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from moespec.decoding.suffix import SuffixDrafter

# proposing costs microseconds: propose before choosing
CHEAP = (PromptLookupDrafter, SuffixDrafter)
QUIET_MAX_GAP = 8  # the longest run of plain steps without a choice, at least (see Speculation)
QUIET_LONGEST = 64  # ... and at most, whatever a choice costs
CHOICE_BUDGET = 0.01  # the share of a plain streak's time its choices may cost
WARM_UP_WAIT = 32  # choices a model drafter's warm-up waits for a cheap drafter's
FIRST_LOOK = 16  # context tokens a greedy model drafter's first look feeds (see Speculation)


@dataclass
class Option:
    drafter: Drafter
    policy: DraftLengthPolicy


@dataclass
class Proposal:
    """This step's draft: who drafted (None: a plain step), the draft length chosen, the
    draft, the cheap drafters' own proposals (scored against what the step emits), and the
    seconds the drafter that drafted took to propose (its h(k), without the choosing)."""

    drafter: str | None
    draft_length: int
    draft: Draft
    shadows: dict[str, list[int]]
    seconds: float = 0.0
    probe: str | None = None  # why the step explores ("warm-up", "probe", "neighbour"), or None


class Speculation:
    """options: {name: (drafter, policy)}; policies of several options should share one
    `RunningMedians` of verify times (`Speculation.auto` builds them so)."""

    def __init__(self, options: dict[str, Option]):
        if not options:
            raise ValueError("speculation needs at least one drafter")
        # Cheap drafters first: they propose before the choice and take warm-up steps.
        self.options = dict(
            sorted(options.items(), key=lambda item: not isinstance(item[1].drafter, CHEAP))
        )
        self.verify_times = next(iter(self.options.values())).policy.verify_times
        for option in self.options.values():
            option.policy.proposes_first = isinstance(option.drafter, CHEAP)
        # Plain streaks skip the choice: after a choice of no draft, the next QUIET_MAX_GAP - 1
        # plain steps at most run without one (the gap doubling from 1 while the choice stays
        # plain, back to 1 once a draft is chosen). On the demo target a step takes 0.3 ms
        # and choosing (lookup's proposal, every option's plan) 0.08 ms, plus the cache it
        # disturbs: 0.1 ms more on the target pass after it (benchmarks/real_draft_eval.py).
        self.quiet, self.quiet_gap = 0, 1
        # The longest gap grows past QUIET_MAX_GAP where a choice costs more than
        # CHOICE_BUDGET of the plain steps between two: with the suffix drafter indexing the
        # steps it missed, a choice cost 0.12 ms on the demo target (its steps 0.5 ms), so
        # eight steps apart choosing alone took 3% of plain decoding. The cost is the median
        # of the last few choices that chose no draft.
        self.choice_costs: deque[float] = deque(maxlen=15)
        self.longest_gap = QUIET_MAX_GAP
        # A plain step of a streak that skips the choice: one shared proposal, which `observe`
        # counts as an idle step and nothing more (its verify time is not recorded: tau(1)
        # comes from the streak's chosen steps, at least one in QUIET_MAX_GAP). At 0.25 ms a
        # demo target step, the proposal, a running median and every policy's bookkeeping
        # came to 16 us a plain step, 6% of plain decoding.
        self.unchosen = Proposal(None, 0, Draft([]), {})
        self.choices = 0
        self.looked: set[str] = set()  # options whose first look has run
        # options whose first look is priced out: (what the price depends on, the idle streak
        # it waits for), not worked out again at every choice while those hold
        self.look_waits: dict[int, tuple] = {}
        self.cheap = any(isinstance(o.drafter, CHEAP) for o in self.options.values())

    @classmethod
    def single(cls, drafter: Drafter, policy: DraftLengthPolicy | None = None) -> "Speculation":
        return cls({drafter.name: Option(drafter, policy or DraftLengthPolicy("auto"))})

    @classmethod
    def auto(
        cls, drafters: Sequence[Drafter], draft_length: int | str = "auto", **policy
    ) -> "Speculation":
        """Several drafters, one policy each (same settings) over shared verify times."""
        shared = RunningMedians(policy.pop("window", 16))
        return cls(
            {
                d.name: Option(d, DraftLengthPolicy(draft_length, measured_verify=shared, **policy))
                for d in drafters
            }
        )

    @property
    def policies(self) -> dict[str, DraftLengthPolicy]:
        return {name: option.policy for name, option in self.options.items()}

    def set_batch(self, batch: int) -> None:
        """Sequences decoded together this step: each policy prices its drafts at its share
        of the batch's pass (`DraftLengthPolicy.batch`)."""
        for option in self.options.values():
            option.policy.batch = batch

    def propose(self, context: list[int], limit: int) -> Proposal:
        """The next step's draft, at most `limit` tokens."""
        if limit <= 0:
            return Proposal(None, 0, Draft([]), {})
        if self.quiet < self.quiet_gap - 1:
            self.quiet += 1
            return self.unchosen
        self.quiet = 0
        start = time.perf_counter()
        proposal = self._choose(context, limit)
        plain = proposal.drafter is None
        if plain:
            self._cost_of_choosing(time.perf_counter() - start)
        self.quiet_gap = min(2 * self.quiet_gap, self.longest_gap) if plain else 1
        return proposal

    def _cost_of_choosing(self, seconds: float) -> None:
        """Set the longest quiet gap from what a plain choice costs (see __init__)."""
        self.choice_costs.append(seconds)
        plain_step = self.verify_times.estimate(1)
        if not plain_step or len(self.choice_costs) < 3:
            return
        cost = statistics.median(self.choice_costs)
        gap = math.ceil(cost / (CHOICE_BUDGET * plain_step))
        self.longest_gap = min(max(gap, QUIET_MAX_GAP), QUIET_LONGEST)

    def _choose(self, context: list[int], limit: int) -> Proposal:
        plans, shadows, seconds, survival = {}, {}, {}, {}
        self.choices += 1
        for name, option in self.options.items():
            policy, cap = option.policy, limit
            if isinstance(option.drafter, CHEAP):
                ask = policy.fixed if policy.fixed is not None else policy.max_draft_length
                start = time.perf_counter()
                draft = option.drafter.propose(context, min(ask, limit))
                seconds[name] = time.perf_counter() - start
                shadows[name], survival[name] = draft.tokens, draft.survival
                cap = len(shadows[name])
                if cap == 0:
                    continue  # nothing to propose: not an option this step
            if name not in self.looked and policy.fixed is None and policy.observations == 0:
                if not self._look_due(option):
                    continue  # not an option until it has been looked at
                self.looked.add(name)  # the plan below reads what the first look saw
                self._probe_for_free(option, context, first=True)
            plans[name] = plan = policy.plan(cap, survival.get(name))
            if plan.probe == "probe" and self._probe_for_free(option, context):
                plans[name] = policy.plan(cap)  # decide again on the new evidence
            elif (
                plan.probe == "warm-up"
                and self.cheap
                and not isinstance(option.drafter, CHEAP)
                and self.choices <= WARM_UP_WAIT
            ):
                plans[name] = Plan(0, None)  # the cheap drafters measure pass sizes first
        name, plan = self._best(plans)
        if name is None or plan.draft_length == 0:
            if name is not None:
                self.options[name].policy.commit(plan)
            return Proposal(None, 0, Draft([]), shadows)
        option = self.options[name]
        option.policy.commit(plan)
        if name in shadows:
            draft = Draft(shadows.pop(name)[: plan.draft_length])
        else:
            start = time.perf_counter()
            draft = option.drafter.propose(context, plan.draft_length)
            seconds[name] = time.perf_counter() - start
        return Proposal(name, plan.draft_length, draft, shadows, seconds[name], plan.probe)

    def _look_due(self, option: Option) -> bool:
        """Whether a greedy model drafter's first look runs now. It waits while the verify
        times are unknown and a cheap drafter can measure them (WARM_UP_WAIT choices at
        most); and when the draft's bytes (`DraftLengthPolicy.draft_byte_ratio`) already
        rule it out at the optimistic acceptance, it is priced like a hopeless probe, at
        FIRST_LOOK draft steps of the byte estimate. Other drafters: at once (a no-op)."""
        drafter, policy = option.drafter, option.policy
        if not isinstance(drafter, ModelDrafter) or not drafter.sampler.greedy:
            return True
        key = (
            policy.verify_times.version,
            policy.draft_times.version,
            policy.draft_byte_ratio,
            policy.accepted,
            policy.rejected,
        )
        waiting = self.look_waits.get(id(option))
        if waiting is not None and waiting[0] == key and policy.idle_streak < waiting[1]:
            return False  # priced out until then (the demo's draft model: every choice)
        table = policy.step_times()
        if table is None:
            return not self.cheap or self.choices > WARM_UP_WAIT
        ratio = policy.draft_byte_ratio
        if ratio is None or len(table) < 2 or not policy.hopeless(table):
            return True
        estimate = FIRST_LOOK * ratio * table[0]
        due = estimate / (table[0] * HOPELESS_BUDGET)
        self.look_waits[id(option)] = key, due
        return policy.idle_streak >= due

    def _probe_for_free(self, option: Option, context: list[int], first: bool = False) -> bool:
        """A greedy model drafter's probe: catch up and score its predictions (no draft),
        then time one one-token draft pass; first: the first look, over the context's last
        FIRST_LOOK tokens. False (nothing run) for other drafters and under sampling."""
        drafter = option.drafter
        if not isinstance(drafter, ModelDrafter) or not drafter.sampler.greedy:
            return False
        start = time.perf_counter()
        window = FIRST_LOOK if first else None
        fed, agreed = drafter.catch_up(context, evidence=True, first_window=window)
        caught_up = time.perf_counter() - start
        one_token = drafter.draft_ahead()
        if not first:
            option.policy.commit(Plan(1, None, "probe"))
        option.policy.observe_agreement(agreed, max(fed - 1 - agreed, 0))
        option.policy.observe_probe(caught_up + one_token, one_token)
        return True

    def _best(self, plans: dict[str, Plan]) -> tuple[str | None, Plan | None]:
        """Warm-up and probe steps first (cheap drafters before model ones), else the highest
        expected throughput (ties: the first option); unknown throughputs lose to known."""
        for name, plan in plans.items():
            if plan.probe in ("warm-up", "probe") and plan.draft_length > 0:
                return name, plan
        best = None
        for name, plan in plans.items():
            score = (plan.throughput is not None, plan.throughput or 0.0)
            if best is None or score > best[0]:
                best = score, name, plan
        return (best[1], best[2]) if best else (None, None)

    def observe(
        self,
        proposal: Proposal,
        accepted: int,
        emitted: list[int],
        verify_seconds: float | None,
    ) -> None:
        """Record a step: the verify time once (None: a pass shared with other sequences,
        whose time is not this step's tau(k + 1)), the acceptance and draft time h(k) (the
        drafter's own `proposal.seconds`, without the choosing) of the drafter that ran, and
        each cheap drafter's unused proposal scored against the emitted tokens."""
        if proposal is self.unchosen:
            for option in self.options.values():
                option.policy.observe_idle()
            return
        drafted = len(proposal.draft.tokens)
        if verify_seconds is not None:
            self.verify_times.add(drafted + 1, verify_seconds)
        for name, option in self.options.items():
            learn = getattr(option.drafter, "learn", None)  # drafters that learn from outcomes
            if name == proposal.drafter:
                option.policy.observe_draft(
                    drafted,
                    accepted,
                    proposal.seconds,
                    catch_up=proposal.draft.catch_up,
                    catch_up_seconds=proposal.draft.catch_up_seconds,
                )
                if learn is not None:
                    learn(accepted, 1 if accepted < drafted else 0)
                continue
            if proposal.drafter is None:  # probes look for gains where nothing drafts
                option.policy.observe_idle()
            shadow = proposal.shadows.get(name)
            if shadow:
                agreed = 0
                while agreed < min(len(shadow), len(emitted)) and shadow[agreed] == emitted[agreed]:
                    agreed += 1
                failed = 1 if agreed < min(len(shadow), len(emitted)) else 0
                option.policy.observe_agreement(agreed, failed)
                if learn is not None:
                    learn(agreed, failed)

    def estimate_for(self, name: str | None) -> float | None:
        """The acceptance estimate of drafter `name`; of the only one when None."""
        if name is None:
            if len(self.options) != 1:
                return None
            name = next(iter(self.options))
        return self.options[name].policy.acceptance_estimate
