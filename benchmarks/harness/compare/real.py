"""Real runs: ``pretrain_gpt.py`` per arm under torchrun (gloo, CPU), and their summaries.

Every arm trains the same model on the same corpus for the same iterations with the
same seed (same document stream); only the arm's packing / budget flags differ.
Each run writes the driver's ``--summary-json``; this module pools runs of one arm
(repeats) and turns them into the per-arm metrics of the report.

Drift: a shared 2-core machine drifts. Runs are ordered in rounds, alternating
forward and reverse order (ABBA), so a linear drift affects every arm equally on
average; with a single round, the baseline arm is run first and last (its two runs
pooled, centred on the middle of the sequence), and the difference between them is
reported as the drift.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.harness import forklaunch
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

from .arms import Arm
from .corpus import CorpusRecipe


@dataclass(frozen=True)
class RealConfig:
    """Model, parallelism and measurement settings of the real runs."""

    recipe: CorpusRecipe = field(default_factory=CorpusRecipe)
    """Corpus and routing (fixed before any arm runs)."""
    ranks: int = 2
    """Processes (pipeline stages; DP = 1)."""
    layers_per_stage: int = 1
    """Transformer layers per pipeline stage."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 2
    """Query heads (head dim 32)."""
    ffn_hidden_size: int = 256
    """MLP width."""
    micro_batches: int = 8
    """Micro-batches per step (global batch size; DP = 1)."""
    iters: int = 23
    """Training iterations per run (the driver skips max(2, 10%) as warm-up)."""
    rounds: int = 1
    """Rounds of all arms (alternating order); 1 = baseline first and last."""
    threads: int = 1
    """OMP_NUM_THREADS per rank."""
    backend: str = "cpu"
    """Sparse attention kernel backend."""
    lr: float = 1e-3
    """Peak learning rate."""
    seed: int = 1234
    """Training seed (model init and document order), same for every arm."""
    timeout_s: float = 1200.0
    """A run taking longer is killed and reported as failed."""
    data_path: Optional[str] = None
    """The user's indexed dataset (``<prefix>.bin/.idx``) instead of the resampled corpus:
    its token ids are the data (NullTokenizer) and ``vocab_size`` is its largest id + 1."""
    vocab_size: Optional[int] = None
    """With ``data_path``: the vocabulary (largest token id + 1)."""

    def __post_init__(self) -> None:
        for name in ("ranks", "layers_per_stage", "hidden_size", "num_attention_heads",
                     "ffn_hidden_size", "micro_batches", "iters", "rounds", "threads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ranks < 2:
            raise ValueError(f"ranks must be >= 2 (pipeline parallel), got {self.ranks}")
        if self.micro_batches < self.ranks:
            raise ValueError(f"micro_batches ({self.micro_batches}) must be >= ranks ({self.ranks})")
        if (self.data_path is None) != (self.vocab_size is None):
            raise ValueError("data_path and vocab_size go together")

    @property
    def num_layers(self) -> int:
        return self.ranks * self.layers_per_stage

    def as_dict(self) -> dict:
        d = asdict(self)
        d["num_layers"] = self.num_layers
        return d

    def _run_flags(self) -> List[str]:
        """The project's run flags; with the user's dataset, its token ids as they are."""
        if self.data_path is None:
            return list(PROJECT_RUN_FLAGS)
        i = PROJECT_RUN_FLAGS.index("--tokenizer-type")
        return [*PROJECT_RUN_FLAGS[:i], "--tokenizer-type", "NullTokenizer", "--vocab-size",
                str(self.vocab_size), *PROJECT_RUN_FLAGS[i + 2:]]

    def model_flags(self) -> List[str]:
        """Model and routing flags shared by the driver and the profiler."""
        r = self.recipe
        return [*self._run_flags(), "--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                "--num-attention-heads", str(self.num_attention_heads),
                "--ffn-hidden-size", str(self.ffn_hidden_size), "--seq-length", str(r.seq_length),
                "--pipeline-model-parallel-size", str(self.ranks),
                "--sb-block-size", str(r.block_size), "--sb-topk", str(r.topk),
                "--sb-attention-backend", self.backend]


def measured_steps(cfg: RealConfig) -> int:
    """Steps the driver counts after its warm-up skip (max(2, 10%)), per run."""
    skip = max(2, cfg.iters // 10)
    return cfg.iters - skip if cfg.iters > skip else cfg.iters


def run_order(arms: Sequence[str], rounds: int, baseline: str = "megatron") -> List[Tuple[str, int]]:
    """(arm, round) in launch order: rounds alternate forward / reverse order; a single
    round puts the baseline first and repeats it last (drift sentinel)."""
    arms = list(arms)
    if rounds == 1:
        rest = [a for a in arms if a != baseline]
        if baseline in arms:
            return [(baseline, 0)] + [(a, 0) for a in rest] + [(baseline, 1)]
        return [(a, 0) for a in rest]
    out = []
    for r in range(rounds):
        out += [(a, r) for a in (arms if r % 2 == 0 else arms[::-1])]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunResult:
    """One launch of one arm."""

    arm: str
    repeat: int
    command: str
    returncode: int
    wall_s: float
    summary: Optional[dict]
    error: str = ""


def driver_command(python: str, repo: str, cfg: RealConfig, arm: Arm, data_prefix: str,
                   summary_path: str, log_dir: str, profile: Optional[str],
                   timeline: Optional[str]) -> List[str]:
    """The torchrun command of one run."""
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.ranks),
           "--master-port", str(_free_port()), "--log-dir", log_dir, "--redirects", "3",
           os.path.join(repo, "pretrain_gpt.py"), "--cpu", "--distributed-backend", "gloo",
           "--data-path", data_prefix, "--split", "98,2,0",
           *cfg.model_flags(), "--global-batch-size", str(cfg.micro_batches),
           "--lr", f"{cfg.lr:g}", "--min-lr", f"{cfg.lr / 10:g}", "--lr-warmup-iters", "2",
           "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--seed", str(cfg.seed),
           "--train-iters", str(cfg.iters), "--log-interval", "1", "--eval-interval", "0",
           "--no-progress-bar", "--summary-json", summary_path, *arm.driver_flags(cfg.recipe.topk)]
    if profile:
        cmd += ["--sb-profile", profile]
    if timeline:
        cmd += ["--sb-timeline", timeline]
    return cmd


def launch(cmd: List[str], cfg: RealConfig, arm: str, repeat: int, summary_path: str,
           out_dir: str, log=print) -> RunResult:
    """Run one command to completion (or timeout); read its summary JSON."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1")
    text = " ".join(shlex.quote(c) for c in cmd)
    log(f"[compare] {arm} (repeat {repeat}): OMP_NUM_THREADS={cfg.threads} {text}")
    t0 = time.time()
    with open(os.path.join(out_dir, "stdout.txt"), "w") as so, \
            open(os.path.join(out_dir, "stderr.txt"), "w") as se:
        proc = forklaunch.popen(cmd, stdout=so, stderr=se, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = -9
    wall = time.time() - t0
    summary, err = None, ""
    if rc == 0 and os.path.isfile(summary_path):
        with open(summary_path) as fh:
            summary = json.load(fh)
    else:
        with open(os.path.join(out_dir, "stderr.txt"), errors="replace") as fh:
            lines = [ln.strip() for ln in fh if "error" in ln.lower()]
        err = (lines[-1] if lines else f"exit code {rc}")[:300]
        if rc == -9:
            err = f"timed out after {cfg.timeout_s:.0f} s"
    log(f"[compare] {arm} (repeat {repeat}): exit {rc} in {wall:.0f} s"
        + (f", median step {summary['step_ms_median']:.0f} ms" if summary else f": {err}"))
    return RunResult(arm, repeat, text, rc, wall, summary, err)


def pool(runs: Sequence[RunResult]) -> Optional[dict]:
    """Per-arm metrics from its successful runs (counted steps pooled)."""
    ok = [r.summary for r in runs if r.summary is not None]
    if not ok:
        return None
    steps, secs, toks, preds = [], 0.0, 0.0, []
    for s in ok:
        counted = s["step_ms_all"][int(s.get("warmup_steps_skipped", 0)):]
        steps += counted
        t = sum(counted) / 1e3
        secs += t
        toks += s["tokens_per_s"] * t
        if s.get("predicted_step_ms_median") is not None:
            preds.append(s["predicted_step_ms_median"])
    med = float(np.median(steps))
    pred = float(np.median(preds)) if preds else None
    bub = np.mean([s["bubble_fraction"] for s in ok], axis=0)
    out = {
        "step_ms": med,
        "step_ms_p25": float(np.percentile(steps, 25)),
        "step_ms_p75": float(np.percentile(steps, 75)),
        "tokens_per_s": toks / secs if secs > 0 else 0.0,
        "loss": float(np.mean([s["loss_last"] for s in ok])),
        "density": float(np.mean([s["density_mean"] for s in ok])),
        "imbalance": float(np.mean([s["imbalance_mean"] for s in ok])),
        "bubble_fraction": [float(x) for x in np.atleast_1d(bub)],
        "predicted_step_ms": pred,
        "validation": (pred - med) / med if pred is not None and med > 0 else None,
        "measured_steps": len(steps),
        "runs": len(ok),
        "run_medians_ms": [float(np.median(s["step_ms_all"][int(s.get("warmup_steps_skipped", 0)):]))
                           for s in ok],
        "loss_first": float(np.mean([s["loss_first"] for s in ok])),
        "plan_ms": (float(np.median([s["plan_ms_median"] for s in ok]))
                    if all(s.get("plan_ms_median") is not None for s in ok) else None),
        "plan_wait_ms": (float(np.median([s["plan_wait_ms_median"] for s in ok]))
                         if all(s.get("plan_wait_ms_median") is not None for s in ok) else None),
        "retained_vs_static": (float(np.mean([s["retained_vs_static"] for s in ok]))
                               if all(s.get("retained_vs_static") is not None for s in ok)
                               else None),
        "pack_ms": float(np.median([s.get("pack_ms_median") or 0.0 for s in ok])),
    }
    return out


def python_exe(repo: str) -> str:
    """The project's venv interpreter (falls back to this interpreter)."""
    venv = os.path.join(repo, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable
