"""Test tiers for parametrised grids: the first case(s) run in the fast tier, the rest are slow."""

import pytest
from _pytest.mark.structures import ParameterSet


def fast_first(values, n: int = 1, *, multi: bool = False) -> list:
    """``values`` of a ``parametrize`` with every case after the first ``n`` marked ``slow``.
    ``multi``: each value is a tuple of several argnames' values."""
    out = []
    for i, value in enumerate(values):
        if i < n:
            out.append(value)
        elif isinstance(value, ParameterSet):
            out.append(pytest.param(*value.values, marks=(*value.marks, pytest.mark.slow), id=value.id))
        else:
            out.append(pytest.param(*value, marks=pytest.mark.slow) if multi else pytest.param(value, marks=pytest.mark.slow))
    return out
