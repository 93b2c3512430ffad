"""The one rule for aux layer ids, where it lives (every stage and the hook call it)."""

from __future__ import annotations

import pytest

from sglang_patch.layer_ids import default_aux_layer_ids, validate_aux_layer_ids


@pytest.mark.parametrize(
    ("ids", "num_layers", "message"),
    [
        ([], 6, "no aux layer ids"),
        ([2, 2], 6, r"aux layer ids \[2, 2\] repeat \[2\]"),
        ([3, 1, 3, 1], None, r"repeat \[1, 3\]"),
        ([7], 6, r"aux layer ids \[7\] are outside 0\.\.6 for a model with 6 decoder layers"),
        ([-1, 2], 6, r"\[-1\] are outside 0\.\.6"),
        ([-1], None, r"\[-1\] are outside 0 or more"),
    ],
)
def test_bad_lists_are_refused_naming_the_ids_and_the_range(ids: list[int], num_layers: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_aux_layer_ids(ids, num_layers)


def test_good_lists_keep_their_order_and_the_final_state_id_is_allowed() -> None:
    assert validate_aux_layer_ids([5, 0, 3], 6) == [5, 0, 3]
    assert validate_aux_layer_ids([6], 6) == [6]  # id n: the last layer's output before the norm
    assert validate_aux_layer_ids((2, 99)) == [2, 99]  # without the depth, only distinct and non-negative


def test_default_is_speculators_and_always_valid_from_seven_layers() -> None:
    assert default_aux_layer_ids(61) == [2, 30, 58]
    for n in range(7, 80):
        assert validate_aux_layer_ids(default_aux_layer_ids(n), n)
