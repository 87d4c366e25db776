"""Hypothesis strategies shared by the cost-model tests: exact Fractions throughout."""

from fractions import Fraction

from hypothesis import strategies as st

positive = st.fractions(min_value=Fraction(1, 100), max_value=100, max_denominator=997)
non_negative = st.fractions(min_value=0, max_value=100, max_denominator=997)
acceptances = st.fractions(min_value=0, max_value=Fraction(99, 100), max_denominator=1009)
unit = st.fractions(min_value=0, max_value=1, max_denominator=101)


def step_tables(min_size: int = 2, max_size: int = 7):
    """V(0)..V(k_max): any positive step times (no shape assumed)."""
    return st.lists(positive, min_size=min_size, max_size=max_size)


@st.composite
def convex_step_tables(draw, min_size: int = 2, max_size: int = 7):
    """Step times with 0 <= c_1 <= c_2 <= ...: convex and non-decreasing."""
    v0 = draw(positive)
    increments = sorted(draw(st.lists(non_negative, min_size=min_size - 1, max_size=max_size - 1)))
    table = [v0]
    for c in increments:
        table.append(table[-1] + c)
    return table
