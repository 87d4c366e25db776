"""Input validation shared by the cost model: one clear ValueError per bad argument."""

from collections.abc import Sequence
from fractions import Fraction
from numbers import Real

Number = float | int | Fraction


def check_acceptance(acceptance: Number, name: str = "acceptance") -> Number:
    """Geometric acceptance a must lie in [0, 1): at a = 1 every draft is accepted forever."""
    acceptance = check_real(acceptance, name)
    if not 0 <= acceptance < 1:
        raise ValueError(f"{name} must be in [0, 1), got {acceptance}")
    return acceptance


def check_real(value: Number, name: str) -> Number:
    """Return the value, with an int made a Fraction so that int / int stays exact."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got NaN")
    return Fraction(value) if isinstance(value, int) else value


def check_positive(value: Number, name: str) -> Number:
    value = check_real(value, name)
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_non_negative(value: Number, name: str) -> Number:
    value = check_real(value, name)
    if not value >= 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


def check_fraction_of_one(value: Number, name: str) -> Number:
    value = check_real(value, name)
    if not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def check_step_times(step_times: Sequence[Number], *, min_length: int = 1) -> list[Number]:
    """V(0), ..., V(k_max): a non-empty table of positive step times (ints made Fractions)."""
    if isinstance(step_times, str | bytes) or not isinstance(step_times, Sequence):
        raise ValueError(
            f"step_times must be a sequence of numbers, got {type(step_times).__name__}"
        )
    if len(step_times) < min_length:
        raise ValueError(
            f"step_times needs at least {min_length} value(s) V(0).., got {len(step_times)}"
        )
    return [check_positive(v, f"step_times[{k}]") for k, v in enumerate(step_times)]


def check_draft_length(draft_length: int, step_times: Sequence[Number]) -> None:
    if isinstance(draft_length, bool) or not isinstance(draft_length, int):
        raise ValueError(f"draft_length must be an integer, got {draft_length!r}")
    if not 0 <= draft_length < len(step_times):
        raise ValueError(
            f"draft_length must be in 0..{len(step_times) - 1} (the step-time table's k_max), "
            f"got {draft_length}"
        )


def check_routing_shape(num_experts: int, top_k: int) -> None:
    """1 <= m < N: a router that picks every expert has nothing to reuse."""
    for value, name in ((num_experts, "num_experts"), (top_k, "top_k")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if top_k >= num_experts:
        raise ValueError(f"top_k must be below num_experts, got top_k={top_k} >= {num_experts}")


def check_top_k(top_k: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")


def check_count(value: int, name: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_bandwidth_error(bandwidth_error: Number, name: str = "bandwidth_error") -> Number:
    bandwidth_error = check_real(bandwidth_error, name)
    if not 0 <= bandwidth_error < 1:
        raise ValueError(f"{name} must be in [0, 1), got {bandwidth_error}")
    return bandwidth_error
