"""Fixtures of the tuning tests."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tuning_cases import SEEDS, SMALL, make  # noqa: E402


@pytest.fixture(params=[(c, s) for c in SMALL for s in SEEDS],
                ids=lambda p: f"{p[0][0]}-pp{p[0][1]}v{p[0][2]}d{p[0][3]}m{p[0][4]}"
                              f"L{len(p[0][5])}-s{p[1]}")
def small(request):
    """Every SMALL case with every seed."""
    return make(*request.param)
