"""Worker behaviour a sampled mutation run found unasserted (issue 18): the range check of a
transfer's ids names exactly the offending ids, so a report points at the bad entries."""

from __future__ import annotations

import pytest

from statecore.errors import SpecError
from statecore.worker import validate_ids


@pytest.mark.parametrize(
    ("blocks", "slots", "message"),
    [
        ([0, 9, 3, 12], [0], r"GPU block ids \[9, 12\] out of range 0\.\.8"),
        ([-1, 2], [0], r"GPU block ids \[-1\] out of range 0\.\.8"),
        ([0], [0, 4, 5, 9], r"CPU slots \[4, 5, 9\] out of range 0\.\.3"),
        ([0], [-2, 1], r"CPU slots \[-2\] out of range 0\.\.3"),
        ([0], [1, 2, 1], r"lists a slot twice"),
    ],
)
def test_validate_ids_names_exactly_the_bad_ids(
    blocks: list[int], slots: list[int], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        validate_ids(blocks, slots, 9, 4)


def test_validate_ids_accepts_the_edges() -> None:
    validate_ids([0, 8], [0, 3], 9, 4)
    validate_ids([], [], 0, 0)
