"""Peak memory per rank in the step log and in the summary JSON.

A PP=2 run over gloo (CPU, so the figure is each process's peak RSS, ``ru_maxrss``):
every log line lists each rank's high-water mark so far, gathered with the step's
row; the summary has the per-rank list, its max and what was measured. The numbers
must be the ranks' own (each worker dumps what its ``train_step`` measured), and they
never go down. This file is also that worker (``worker`` mode, under torchrun).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS = 3


def _worker(argv) -> None:
    """pretrain(argv); ``$SB_TEST_DUMP/rank<r>.json`` = this rank's measured peak per step."""
    sys.path.insert(0, ROOT)
    import torch

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import shutdown
    from megatron.training.training import pretrain

    peaks = []
    pretrain(parse_args(argv), on_step=lambda it, state, result: peaks.append(result.peak_memory_mb))
    dump = os.environ["SB_TEST_DUMP"]
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(peaks, f)
    shutdown()


if __name__ != "__main__":
    import numpy as np
    import pytest
    import torch
    from conftest import TINY, launch, summary_of

    @pytest.fixture(scope="module")
    def run(corpus, tmp_path_factory):
        root = tmp_path_factory.mktemp("mem")
        dump, summary = str(root / "dump"), str(root / "summary.json")
        proc = launch(os.path.abspath(__file__), ["worker", *TINY, "--pipeline-model-parallel-size", "2",
                                                  "--data-path", corpus, "--train-iters", str(STEPS),
                                                  "--summary-json", summary], nproc=2,
                      extra_env={"SB_TEST_DUMP": dump})
        printed = summary_of(proc)
        measured = [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)]
        return {"proc": proc, "summary": json.load(open(summary)), "printed": printed,
                "measured": np.array(measured)}  # [rank, step]

    def test_every_log_line_has_each_ranks_peak(run):
        lines = [ln for ln in run["proc"].stdout.splitlines() if ln.startswith("iter ")]
        assert len(lines) == STEPS
        for step, line in enumerate(lines):
            m = re.search(r"\| peak mem MB \[([0-9 ]+)\]", line)
            assert m, line
            shown = [float(x) for x in m.group(1).split()]
            np.testing.assert_allclose(shown, run["measured"][:, step], atol=0.5)

    def test_summary_has_per_rank_peaks_and_max(run):
        s, measured = run["summary"], run["measured"]
        assert s == run["printed"]  # --summary-json and the SUMMARY_JSON line agree
        assert s["peak_memory_source"] == "ru_maxrss"
        assert len(s["peak_memory_mb"]) == 2
        np.testing.assert_allclose(s["peak_memory_mb"], measured.max(axis=1))
        assert s["peak_memory_mb_max"] == max(s["peak_memory_mb"])
        assert s["flex_compiles"] == 0  # the flex backend never ran here
        assert s["routing"] == "torch"  # the fused route runs on CUDA only
        assert s["loss_path"] == "megatron-core"  # no --cross-entropy-fusion-impl linear
        assert s["kernel_compiles_after_step_2"] == 0 and len(s["kernel_compiles_all"]) == len(s["step_ms_all"])
        assert s["kernel_compiles_by_kind"] == {"fa4": 0, "flex": 0, "route_kernels": 0}
        if len(s["step_ms_all"]) > 2:  # by kind from step 2 to the last (naming a late compile)
            assert s["kernel_compiles_late_by_kind"] == {"fa4": 0, "flex": 0, "route_kernels": 0}
        # a high-water mark: never down from step to step; a torch process is >100 MB
        assert (np.diff(measured, axis=1) >= 0).all(), measured
        assert (measured > 100).all() and (measured < 64 * 1024).all(), measured

    def test_cpu_peak_is_the_process_high_water_mark():
        """In a fresh process: a tensor bigger than the peak so far (imports can leave a
        high-water mark above the RSS), freed, still shows in the peak (not in the RSS)."""
        code = ("import sys; sys.path.insert(0, %r)\n"
                "import torch\n"
                "import os\n"
                "from megatron.training.step import peak_memory_mb\n"
                "page = os.sysconf('SC_PAGE_SIZE')\n"
                "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * page / 2**20\n"
                "before = peak_memory_mb(cpu=True)\n"
                "x = torch.ones(int((before + 256) * 2**18)); del x\n"
                "print(before, peak_memory_mb(cpu=True), rss())\n" % ROOT)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        before, after, now = map(float, out.stdout.split()[-3:])
        assert after >= before + 200, (before, after)
        assert now < after - 150, (after, now)

    def test_large_worlds_log_the_max_only():
        from megatron.training.run_log import peak_memory_text

        assert peak_memory_text([1000.4, 1200.0]) == "peak mem MB [1000 1200]"
        peaks = [1000.0] * 64
        peaks[37] = 2048.0
        assert peak_memory_text(peaks) == "peak mem MB max 2048 (rank 37)"

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    def test_gpu_peak_is_max_allocated():
        from megatron.training.step import peak_memory_mb, peak_memory_source

        x = torch.ones(32 * 2**20, device="cuda")  # 128 MB
        assert peak_memory_mb(cpu=False) == torch.cuda.max_memory_allocated() / 2**20 >= 128
        assert peak_memory_source(cpu=False) == "cuda_max_allocated"
        del x


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        raise SystemExit("usage: test_memory_report.py worker <pretrain_gpt.py flags>")
    _worker(sys.argv[2:])
