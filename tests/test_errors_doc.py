"""Rows of docs/errors.md that no other test holds: each bad input and the message it gets."""

from __future__ import annotations

import pytest

from kvtier.speculative import SpeculativeConfig


@pytest.mark.parametrize("name", ["verify_cost", "draft_cost"])
@pytest.mark.parametrize("cost", [-0.1, 10, 10.0, float("nan"), float("inf"), True, "1"])
def test_a_cost_outside_0_to_10_names_the_field_and_the_range(name, cost):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(**{name: cost})
    assert str(e.value) == f"{name} must be a number in [0, 10) (one-token forwards), got {cost!r}"


@pytest.mark.parametrize("name", ["verify_cost", "draft_cost"])
@pytest.mark.parametrize("cost", [0, 0.0, 9.99])
def test_a_cost_inside_0_to_10_is_taken(name, cost):
    assert getattr(SpeculativeConfig(**{name: cost}), name) == cost
