"""Expert bytes, verify time and the saving of deduplication (seed 000 §1, §3.1, §3.4).

A pass of n tokens needs the experts of all n. A per-slot kernel requests E_slot(n) = n m W bytes
(one expert read per slot); a deduplicating kernel requests the union bytes
E_dedup(n) = sum_l w_l U_l(n). Time is bytes over each kernel's effective bandwidth, plus fixed
time (eq. 5). Pure functions of numbers; exact on `fractions.Fraction` inputs.
"""

from collections.abc import Mapping, Sequence
from fractions import Fraction

from moespec.costmodel._checks import (
    Number,
    check_acceptance,
    check_count,
    check_fraction_of_one,
    check_non_negative,
    check_positive,
    check_real,
    check_routing_shape,
    check_top_k,
)
from moespec.costmodel.speculation import _geometric_sum


def verify_time(
    requested_bytes: Number,
    bandwidth: Number,
    *,
    pass_dense_bytes: Number = 0,
    dense_bandwidth: Number | None = None,
    outside_time: Number = 0,
    fixed_work: Number = 0,
) -> Number:
    """tau_p(n) = t0 + D(n)/beta_D + E_p(n)/beta_p(n) + phi_p(n), eq. (5).

    requested_bytes: E_p(n), the expert bytes kernel p requests on the pass;
    bandwidth: beta_p(n), that kernel's effective bandwidth at this pass size;
    pass_dense_bytes: D(n) = D + kv(n-1), bytes read once per pass at dense_bandwidth beta_D;
    outside_time: t0, time outside the memory reads; fixed_work: phi_p(n), e.g. launches.
    """
    requested_bytes = check_non_negative(requested_bytes, "requested_bytes")
    bandwidth = check_positive(bandwidth, "bandwidth")
    outside_time = check_non_negative(outside_time, "outside_time")
    fixed_work = check_non_negative(fixed_work, "fixed_work")
    dense_time = _dense_time(pass_dense_bytes, dense_bandwidth, "pass_dense_bytes")
    return outside_time + dense_time + requested_bytes / bandwidth + fixed_work


def _dense_time(nbytes: Number, bandwidth: Number | None, name: str) -> Number:
    """Bytes read once per pass over the dense bandwidth beta_D (0 when there are none)."""
    nbytes = check_non_negative(nbytes, name)
    if not nbytes:
        return 0
    if bandwidth is None:
        raise ValueError(f"dense_bandwidth is required when {name} is non-zero")
    return nbytes / check_positive(bandwidth, "dense_bandwidth")


def saving(
    slot_bytes: Number,
    slot_bandwidth: Number,
    byte_share: Number,
    bandwidth_ratio: Number,
    *,
    fixed_work_gap: Number = 0,
) -> Number:
    """S(n) = tau_slot(n) - tau_dedup(n) = E_slot/beta_slot * (1 - u(n)/r(n)), eq. (6).

    With f_l = 1, t0 and the dense reads cancel. Unequal fixed work subtracts
    fixed_work_gap = phi_dedup(n) - phi_slot(n). Positive: deduplication is faster.
    """
    slot_bytes = check_non_negative(slot_bytes, "slot_bytes")
    slot_bandwidth = check_positive(slot_bandwidth, "slot_bandwidth")
    byte_share = check_fraction_of_one(byte_share, "byte_share")
    bandwidth_ratio = check_positive(bandwidth_ratio, "bandwidth_ratio")
    fixed_work_gap = check_real(fixed_work_gap, "fixed_work_gap")
    return slot_bytes / slot_bandwidth * (1 - byte_share / bandwidth_ratio) - fixed_work_gap


def dedup_is_faster(byte_share: Number, bandwidth_ratio: Number) -> bool:
    """Eq. (7): with equal fixed work, deduplication is faster exactly when u(n) < r(n)."""
    byte_share = check_fraction_of_one(byte_share, "byte_share")
    bandwidth_ratio = check_positive(bandwidth_ratio, "bandwidth_ratio")
    return byte_share < bandwidth_ratio


def crossover(savings: Mapping[int, Number] | Sequence[Number]) -> int | None:
    """The smallest pass size n from which the saving S(n) stays positive; None if never.

    `savings` maps pass size n to S(n), or is a sequence [S(1), S(2), ...]. "Stays positive"
    is over the pass sizes given: the crossover is the first n after the last non-positive S.
    """
    table = _pass_size_table(savings, "savings")
    result = None
    for n in sorted(table):
        if table[n] > 0:
            if result is None:
                result = n
        else:
            result = None
    return result


def _pass_size_table(values, name: str) -> dict[int, Number]:
    if isinstance(values, Mapping):
        table = dict(values)
    elif isinstance(values, Sequence) and not isinstance(values, str | bytes):
        table = {n: v for n, v in enumerate(values, start=1)}
    else:
        raise ValueError(f"{name} must be a mapping of pass size to value or a sequence")
    if not table:
        raise ValueError(f"{name} must not be empty")
    for n, v in table.items():
        check_count(n, f"{name} pass size")
        check_real(v, f"{name}[{n}]")
    return table


def union_from_reuse(reuse: Sequence[Number], top_k: int) -> list[Number]:
    """U(n) = m * sum_{j<=n} (1 - rho(j)), eq. (2) (and (12) summed over bytes).

    reuse: [rho(1), rho(2), ..., rho(n_max)] with rho(1) = 0 by definition (1).
    Returns [U(1), ..., U(n_max)].
    """
    check_top_k(top_k)
    if isinstance(reuse, str | bytes) or not isinstance(reuse, Sequence) or not reuse:
        raise ValueError("reuse must be a non-empty sequence [rho(1), rho(2), ...]")
    for j, rho in enumerate(reuse, start=1):
        check_fraction_of_one(rho, f"reuse[{j - 1}] (rho({j}))")
    if reuse[0] != 0:
        raise ValueError(f"reuse[0] is rho(1), which is 0 by definition (1); got {reuse[0]}")
    unions, total = [], 0
    for rho in reuse:
        total = total + top_k * (1 - rho)
        unions.append(total)
    return unions


def uniform_union(num_experts: int, top_k: int, n_tokens: int) -> Number:
    """N (1 - q^n), q = 1 - m/N: mean distinct experts of n tokens under independent uniform
    routing (Huang et al., 2025; seed 000 §1)."""
    check_routing_shape(num_experts, top_k)
    check_count(n_tokens, "n_tokens", minimum=0)
    q = 1 - Fraction(top_k, num_experts)
    return num_experts * (1 - q**n_tokens)


def uniform_reuse(num_experts: int, top_k: int, n_tokens: int) -> Number:
    """rho(n) = 1 - q^(n-1) under independent uniform routing (seed 000 §1)."""
    check_routing_shape(num_experts, top_k)
    check_count(n_tokens, "n_tokens")
    q = 1 - Fraction(top_k, num_experts)
    return 1 - q ** (n_tokens - 1)


def byte_share(
    unions: Sequence[Number],
    expert_bytes: Sequence[Number],
    top_k: int,
    n_tokens: int,
    byte_factors: Sequence[Number] | None = None,
) -> Number:
    """u(n) = f E_dedup(n) / E_slot(n) = sum_l f_l w_l U_l(n) / (n m W) (Sec. 2, eq. 5).

    unions: U_l(n) per layer; expert_bytes: w_l per layer (bytes of one expert of layer l as
    held: an int8 expert's values and scales); byte_factors: f_l per layer, the bytes the
    deduplicating kernel reads per distinct expert over w_l (Table 6; default 1).
    """
    check_top_k(top_k)
    check_count(n_tokens, "n_tokens")
    _check_layers(unions, expert_bytes)
    factors = [1] * len(expert_bytes) if byte_factors is None else list(byte_factors)
    _check_layers(factors, expert_bytes)
    for layer, f in enumerate(factors):
        if check_real(f, f"byte_factors[{layer}]") < 1:
            raise ValueError(f"byte_factors[{layer}] = {f}: f_l >= 1 (eq. 5)")
    for layer, u in enumerate(unions):
        if not top_k <= u <= top_k * n_tokens:
            raise ValueError(
                f"unions[{layer}] = {u} is outside [m, n m] = [{top_k}, {top_k * n_tokens}]"
            )
    dedup = sum(f * w * u for f, w, u in zip(factors, expert_bytes, unions, strict=True))
    return check_real(dedup, "union bytes") / (n_tokens * top_k * sum(expert_bytes))


def slot_expert_bytes(total_expert_bytes: Number, top_k: int, n_tokens: int) -> Number:
    """E_slot(n) = n m W (§1): a per-slot kernel reads one routed expert per (token, slot)."""
    total_expert_bytes = check_positive(total_expert_bytes, "total_expert_bytes")
    check_top_k(top_k)
    check_count(n_tokens, "n_tokens")
    return n_tokens * top_k * total_expert_bytes


def union_expert_bytes(unions: Sequence[Number], expert_bytes: Sequence[Number]) -> Number:
    """E_dedup(n) = sum_l w_l U_l(n) (§1): a deduplicating kernel reads each distinct routed
    expert of the pass once. unions: U_l(n) per MoE layer; expert_bytes: w_l per layer."""
    _check_layers(unions, expert_bytes)
    for layer, u in enumerate(unions):
        check_non_negative(u, f"unions[{layer}]")
    return sum(w * u for w, u in zip(expert_bytes, unions, strict=True))


def pass_bytes(requested_expert_bytes: Number, dense_bytes: Number, kv_bytes: Number = 0):
    """The bytes of a pass of eq. (5): D + E_p(n) + kv. Only routed experts deduplicate
    (E_p); D is everything a pass reads once whatever the routing: attention, norms,
    routers, the output head, shared experts and the MLPs of dense layers."""
    requested_expert_bytes = check_non_negative(requested_expert_bytes, "requested_expert_bytes")
    dense_bytes = check_non_negative(dense_bytes, "dense_bytes")
    return dense_bytes + requested_expert_bytes + check_non_negative(kv_bytes, "kv_bytes")


def _check_layers(per_layer: Sequence[Number], expert_bytes: Sequence[Number]) -> None:
    if not expert_bytes:
        raise ValueError("expert_bytes must list w_l for at least one layer")
    if len(per_layer) != len(expert_bytes):
        raise ValueError(
            f"one value per layer expected: got {len(per_layer)} against "
            f"{len(expert_bytes)} entries of expert_bytes"
        )
    for layer, w in enumerate(expert_bytes):
        check_positive(w, f"expert_bytes[{layer}]")


def mean_reuse(
    reuse_by_layer: Sequence[Sequence[Number]], expert_bytes: Sequence[Number], draft_length: int
) -> Number:
    """rho_bar_k = (1/(k W)) sum_{j=2}^{k+1} sum_l w_l rho_l(j), eq. (11).

    reuse_by_layer[l] = [rho_l(1), rho_l(2), ...] with at least k+1 entries.
    """
    check_count(draft_length, "draft_length")
    _check_layers(reuse_by_layer, expert_bytes)
    total = 0
    for layer, (w, reuse) in enumerate(zip(expert_bytes, reuse_by_layer, strict=True)):
        if len(reuse) < draft_length + 1:
            raise ValueError(
                f"reuse_by_layer[{layer}] needs rho(1..{draft_length + 1}), got {len(reuse)} values"
            )
        for j in range(2, draft_length + 2):
            rho = check_fraction_of_one(reuse[j - 1], f"reuse_by_layer[{layer}][{j - 1}]")
            total = total + w * rho
    return total / check_real(draft_length * sum(expert_bytes), "total_expert_bytes")


def dedup_expert_bytes(
    total_expert_bytes: Number, top_k: int, draft_length: int, mean_reuse: Number
) -> Number:
    """E_dedup(k+1) = m W + m W k (1 - rho_bar_k), eq. (12): union bytes of a pass of k+1 tokens."""
    total_expert_bytes = check_positive(total_expert_bytes, "total_expert_bytes")
    check_top_k(top_k)
    check_count(draft_length, "draft_length", minimum=0)
    mean_reuse = check_fraction_of_one(mean_reuse, "mean_reuse")
    mw = top_k * total_expert_bytes
    return mw + mw * draft_length * (1 - mean_reuse)


def reuse_threshold(
    acceptance: Number,
    draft_length: int,
    *,
    plain_verify_time: Number,
    top_k: int,
    total_expert_bytes: Number,
    bandwidth: Number,
    plain_bandwidth: Number,
    dense_growth: Number = 0,
    dense_bandwidth: Number | None = None,
    fixed_work_growth: Number = 0,
) -> Number:
    """rho*_k(a), eq. (14): the least mean reuse rho_bar_k at which draft length k is faster
    than plain decoding on a deduplicating engine (f_l = 1, h = 0; (B.14)).

    rho* = 1 - (1/k) [ B_k Y / (m W) + B_k/beta(1) - 1 ],
    Y = (G_a(k) - 1) tau(1) - dD_k/beta_D - dphi_k  (the time a draft may add outside expert reads).

    plain_verify_time: tau(1); bandwidth: B_k = beta_dedup(k+1); plain_bandwidth: beta(1);
    dense_growth: dD_k = D(k+1) - D(1) in bytes at dense_bandwidth beta_D;
    fixed_work_growth: dphi_k = phi_dedup(k+1) - phi(1).
    """
    acceptance = check_acceptance(acceptance)
    check_count(draft_length, "draft_length")
    plain_verify_time = check_positive(plain_verify_time, "plain_verify_time")
    check_top_k(top_k)
    total_expert_bytes = check_positive(total_expert_bytes, "total_expert_bytes")
    bandwidth = check_positive(bandwidth, "bandwidth")
    plain_bandwidth = check_positive(plain_bandwidth, "plain_bandwidth")
    fixed_work_growth = check_real(fixed_work_growth, "fixed_work_growth")
    dense_time = _dense_time(dense_growth, dense_bandwidth, "dense_growth")
    accepted = _geometric_sum(acceptance, draft_length) - 1
    room = accepted * plain_verify_time - dense_time - fixed_work_growth
    mw = top_k * total_expert_bytes
    return 1 - (bandwidth * room / mw + bandwidth / plain_bandwidth - 1) / draft_length


def reuse_threshold_bytes(
    acceptance: Number,
    draft_length: int,
    *,
    plain_step_bytes: Number,
    top_k: int,
    total_expert_bytes: Number,
    kv_growth: Number = 0,
) -> Number:
    """rho*_k(a) in byte form, eq. (16) / (B.16): one bandwidth for every byte, t0 = phi = 0.

    rho* = 1 - [ (G_a(k) - 1) V_dedup(0) - (kv(k) - kv(0)) ] / (m W k),
    plain_step_bytes: V_dedup(0) = D + m W + kv(0); kv_growth: kv(k) - kv(0).
    """
    acceptance = check_acceptance(acceptance)
    check_count(draft_length, "draft_length")
    plain_step_bytes = check_positive(plain_step_bytes, "plain_step_bytes")
    check_top_k(top_k)
    total_expert_bytes = check_positive(total_expert_bytes, "total_expert_bytes")
    kv_growth = check_non_negative(kv_growth, "kv_growth")
    accepted = _geometric_sum(acceptance, draft_length) - 1
    return 1 - (accepted * plain_step_bytes - kv_growth) / (
        top_k * total_expert_bytes * draft_length
    )
