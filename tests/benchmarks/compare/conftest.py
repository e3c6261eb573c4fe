"""Fixtures shared by the tests of benchmarks/real_accuracy.py."""

import pytest


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    """real_accuracy.py's checked arguments for a checkpoint with SmolLM2-135M's flags (no run)."""
    from test_real_accuracy_sens import SMOLLM2_FLAGS

    from benchmarks import real_accuracy as R

    d = tmp_path_factory.mktemp("ckpt")
    (d / "model_flags.txt").write_text(SMOLLM2_FLAGS)
    a = R.build_parser().parse_args(["--load", str(d), "--num-microbatches", "0", "--num-samples", "0"])
    R.check_args(a)
    return a
