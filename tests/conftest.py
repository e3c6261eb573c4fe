"""Shared pytest setup: the repo root is importable (``megatron.training``, ``sparsebalance``)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    # megatron-core warns once per module that TE/Apex are absent: expected on CPU.
    config.addinivalue_line("filterwarnings", "ignore:.*Transformer Engine and Apex are not installed.*")
    config.addinivalue_line("filterwarnings", "ignore:.*full scope is deprecated.*")
