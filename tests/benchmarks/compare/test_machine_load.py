"""Machine-load check of the real runs, on injected readings."""

import itertools

import pytest

from benchmarks.harness.compare.machine_load import LoadSample, idle_window, other_cores, sample, verdict


def S(t, busy, own, load=0.5):
    return LoadSample(t=t, busy_s=busy, own_s=own, loadavg=load)


def test_own_runs_are_not_competition():
    # 100 s, the system busy for 190 CPU s, all of it this process and its children.
    assert other_cores(S(0, 1000, 10), S(100, 1190, 200)) == pytest.approx(0.0)


def test_other_processes_counted_in_cores():
    # 100 s: system busy 250 CPU s, ours 150: others used 1.0 core on average.
    assert other_cores(S(0, 0, 0), S(100, 250, 150)) == pytest.approx(1.0)


def test_quiet_machine_no_warning():
    rec = verdict((S(0, 0, 0), S(2, 0.1, 0)), (S(2, 0.1, 0), S(102, 190.1, 185)), ncpu=2)
    assert rec["warning"] is None and rec["other_cores_during"] == pytest.approx(0.05)


@pytest.mark.parametrize("idle, runs", [
    ((S(0, 0, 0), S(2, 2.0, 0)), (S(2, 2, 0), S(102, 192, 190))),          # busy before only
    ((S(0, 0, 0), S(2, 0.0, 0)), (S(2, 0, 0, 1.2), S(102, 250, 190, 2.7))),  # busy during
])
def test_competition_gives_one_warning_line(idle, runs):
    rec = verdict(idle, runs, ncpu=2)
    w = rec["warning"]
    assert w is not None and w.startswith("WARNING") and "\n" not in w
    assert f"{runs[0].loadavg:.2f} before" in w


def test_idle_window_samples_around_the_wait():
    clock = itertools.count(0.0, 3.0)
    readings = iter([10.0, 13.0])
    slept = []
    read = lambda: sample(busy=lambda: next(readings), own=lambda: 0.0,  # noqa: E731
                          loadavg=lambda: 0.1, clock=lambda: next(clock))
    a, b = idle_window(2.5, sleep=slept.append, read=read)
    assert slept == [2.5] and other_cores(a, b) == pytest.approx(1.0)


def test_reads_this_machine():
    s = sample()
    assert s.busy_s > 0 and s.own_s >= 0 and s.loadavg >= 0
