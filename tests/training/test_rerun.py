"""``--rerun-mode validate_results`` (Megatron-LM's result validation, ``megatron/training/rerun.py``):
a rejected step is re-run from the same state on the same data before its optimizer step; a
transient error goes on with the re-run's result (the losses of a run without the error), a
persistent one stops the run in one line naming the iteration, with nothing saved."""

import math
import os

import numpy as np
import pytest
from conftest import PRETRAIN, TINY, summary_of

from megatron.training.rerun import RerunConfig, ResultValidator

RUN = [*TINY, "--train-iters", "3", "--pipeline-model-parallel-size", "2"]


def _validator(**kw) -> ResultValidator:
    v = ResultValidator(RerunConfig(mode="validate_results", **kw), rank=0, warn=lambda m: None)
    v.first_iteration_done = True
    return v


def test_nonfinite_loss_reproduced_stops_and_not_reproduced_goes_on():
    with pytest.raises(ValueError, match=r"^iteration 5: .*loss nan.*persistent error"):
        _validator().check(5, math.nan, lambda: math.nan, device=None)
    assert _validator().check(5, math.inf, lambda: 2.5, device=None) == 2.5  # transient: the re-run's result
    reruns = []
    assert _validator().check(5, 1.0, lambda: reruns.append(1) or 1.0, device=None) == 1.0 and not reruns


def test_injection_types_and_first_iteration():
    with pytest.raises(ValueError, match="injected correct_result"):  # matches on re-run, as Megatron-LM's
        _validator(injection_rate=1, injection_type="correct_result").check(2, 1.0, lambda: 1.0, device=None)
    assert _validator(injection_rate=1).check(2, 1.0, lambda: 3.0, device=None) == 3.0
    first = ResultValidator(RerunConfig("validate_results", 1, "persistent_error"), rank=0, warn=lambda m: None)
    assert first.check(1, math.nan, lambda: math.nan, device=None) != 0  # a job's first iteration: unchecked
    with pytest.raises(ValueError, match="rerun-mode"):
        RerunConfig(mode="report_stats")


def test_injected_transient_error_reruns_with_the_same_losses(world, corpus):
    plain = summary_of(world.launch(PRETRAIN, [*RUN, "--data-path", corpus], nproc=2))
    proc = world.launch(PRETRAIN, [*RUN, "--data-path", corpus, "--rerun-mode", "validate_results",
                                   "--error-injection-rate", "1", "--error-injection-type", "transient_error"],
                        nproc=2)
    injected = summary_of(proc)
    assert proc.stderr.count("possible transient error") == 2, proc.stderr[-2000:]  # iterations 2 and 3
    np.testing.assert_array_equal(injected["losses"], plain["losses"])


def test_injected_persistent_error_stops_in_one_line(world, corpus, tmp_path):
    save = tmp_path / "ckpt"
    proc = world.launch(PRETRAIN, [*RUN, "--data-path", corpus, "--rerun-mode", "validate_results",
                                   "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
                                   "--save", str(save), "--save-interval", "1"], nproc=2)
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if "persistent error" in ln]  # one line per rank
    assert len(lines) == 2 and all("] iteration 2: " in ln for ln in lines), proc.stderr[-2000:]
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == ["iter_0000001"]
