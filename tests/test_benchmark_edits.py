"""The benchmarks that time edited copies of lightmem's code still find what they edit.

``benchmarks/keep_cost.py`` removes parts of ``Offloader.pack`` by anchor lines; a refactor of the
engine that moves those lines would otherwise only show when someone runs the benchmark. Nothing
here is timed.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import keep_cost  # noqa: E402


# A name each removed part uses and the rest of pack does not.
REMOVED_NAMES = {
    "lightmem keeping without the record": "_KeptStorage",
    "lightmem keeping without the cycle rule": "BackwardCFunction",
    "lightmem keeping without the pre-checks": "_capturing",
}


def test_every_part_keep_cost_removes_is_found_once_and_taken_out_of_the_engines_pack():
    assert set(keep_cost.WITHOUT) == set(REMOVED_NAMES)
    whole = keep_cost.engine.Offloader.pack.__code__.co_names
    for name, (first, last, replacement) in keep_cost.WITHOUT.items():
        edited = keep_cost._pack_without(first, last, replacement).__code__.co_names
        assert (REMOVED_NAMES[name] in whole, REMOVED_NAMES[name] in edited) == (True, False)
