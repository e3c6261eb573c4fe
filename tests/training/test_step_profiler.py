"""Megatron-LM's ``--profile --use-pytorch-profiler``: the window's steps are profiled, their
kernel time split into attention and the rest, the trace written to ``--tensorboard-dir``
and the profiled steps left out of the summary's timing."""

import json
import os

from conftest import PRETRAIN, TINY, launch, summary_of


def test_pytorch_profiler_window(corpus, tmp_path):
    tb = tmp_path / "tb"
    flags = [*TINY, "--data-path", corpus, "--train-iters", "4", "--profile", "--use-pytorch-profiler",
             "--profile-step-start", "2", "--profile-step-end", "3", "--tensorboard-dir", str(tb),
             "--summary-json", str(tmp_path / "s.json")]
    proc = launch(PRETRAIN, flags)
    s = summary_of(proc)
    assert s["step_profiled_all"] == [False, False, True, False]
    assert s["profiled_steps"] == 1
    p = s["profile"]
    assert p["iterations"] == [3, 3] and p["device"] == "cpu"
    assert p["wall_ms"] > 0 and p["device_busy_ms"] is None  # no accelerator
    # the tiny model's dense attention is CPU SDPA: a part of the kernel time, not all of it
    assert 0 < p["attention_ms"] < p["kernel_ms"] and 0 < p["attention_share"] < 1
    assert os.path.basename(p["trace"]) == "profile_rank0_iter3-3.pt.trace.json"
    with open(p["trace"]) as fh:
        assert json.load(fh)["traceEvents"]
    assert "profile of iterations 3-3" in proc.stdout


def test_profile_window_must_be_ordered(corpus):
    proc = launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "2", "--profile",
                             "--profile-step-start", "3", "--profile-step-end", "3"])
    assert proc.returncode != 0
    assert "--profile-step-end 3 must be after --profile-step-start 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_device_busy_time_is_the_union_of_kernel_intervals():
    from types import SimpleNamespace as NS

    from megatron.training.profiling import device_busy_ms

    k = lambda a, b, dev="DeviceType.CUDA": NS(device_type=dev, time_range=NS(start=a, end=b))
    # overlapping kernels on two streams count once; a gap does not count; CPU ops are not kernels
    events = [k(0, 1000), k(500, 1500), k(3000, 3500), k(0, 9000, "DeviceType.CPU")]
    assert device_busy_ms(events) == 2.0
    assert device_busy_ms([k(0, 9000, "DeviceType.CPU")]) is None
