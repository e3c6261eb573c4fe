"""Fault-injection trials: kill a rank of a PP=2 ``--sparse-balance`` run at a seeded
random point, resume it, and check that nothing hung, no damaged checkpoint was
loaded, and the resumed steps equal an uninterrupted run's bit for bit.

Tiny CPU run (what CI runs: two trials side by side; about a minute per trial on 2 cores)::

    .venv/bin/python benchmarks/fault_trials.py --trials 2 --seed 0 --jobs 2 --json

The 30-trial run behind results/fault_trials.json::

    .venv/bin/python benchmarks/fault_trials.py --trials 30 --seed 0 --jobs 2 --output results/fault_trials.json

(On a GPU node the same harness runs; it trains a tiny model on gloo/CPU by design:
the faults it injects are about processes and files, not kernels.)

Each trial, seeded by (``--seed``, trial number):

1. picks a victim rank (0 or 1), a phase and a point in it: ``forward`` (the N-th
   micro-batch forward of step I), ``p2p`` (the N-th pipeline send/receive of step
   I), ``optimizer`` (the optimizer step of step I) or ``checkpoint`` (the save after
   step I, once the victim's shards are written and before the manifest);
2. trains ``--train-iters`` steps with ``--save-interval`` saves, two ranks started
   by hand (not torchrun, which would kill the survivor itself: this is a node
   vanishing), ``--step-timeout-minutes`` watchdog on; the victim SIGKILLs itself at
   that point (``tests/training/_fault_worker.py``, ``SB_TEST_KILL``);
3. the survivor must exit non-zero on its own within the watchdog timeout plus a
   margin (else: a hang, and the harness kills it);
4. every checkpoint directory is verified against its manifest; the run is resumed
   with ``--load`` (same directory) to the end, and must load the newest intact
   checkpoint (a damaged one loaded counts as a failure);
5. the resumed steps' losses (this rank's loss sum and tokens), packing, DST budget
   tables, per-call attention budgets and sampler states must equal those of the
   uninterrupted reference run (made once, same flags, no fault).

Measured op times are replaced by a deterministic function of (step, stage,
micro-batch) in every run (the worker's ``SB_TEST_DET_TIMES``), so DST budgets are
comparable across runs. Exit status: 0 if every trial passed, 1 if any failed, 2
on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, NoReturn, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.harness import forklaunch  # noqa: E402
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402
from megatron.training.arguments import OneLineParser, _non_negative, _positive, usage_error  # noqa: E402

PROG = "fault_trials.py"
WORKER = os.path.join(REPO, "tests", "training", "_fault_worker.py")
PHASES = ("forward", "p2p", "optimizer", "checkpoint")
MODEL = [*PROJECT_RUN_FLAGS, "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "256", "--global-batch-size", "4",
         "--lr", "1e-3", "--log-interval", "1", "--no-progress-bar", "--seed", "7",
         "--pipeline-model-parallel-size", "2", "--sparse-balance", "--sb-block-size", "32",
         "--sb-topk", "4", "--sb-cost-model", "h100-analytic"]
MICROBATCHES = 4  # --global-batch-size / DP
COMPARED = ("loss_sum", "loss_tokens", "packing", "budget", "records", "sampler")


def fail(message: str, code: int = 2) -> NoReturn:
    """One ``fault_trials.py: error:`` line on stderr, then exit ``code``."""
    usage_error(message, prog=PROG, code=code)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--trials", type=_positive(int), required=True, help="number of seeded trials")
    p.add_argument("--seed", type=_non_negative(int), default=0, help="seed of the fault points")
    p.add_argument("--json", action="store_true", help="print the JSON summary instead of a table")
    p.add_argument("--output", default=None, metavar="PATH", help="also write the JSON summary here")
    p.add_argument("--data-path", default=None,
                   help="indexed dataset prefix (default: a synthetic 300-document corpus, "
                        "tools/make_corpus.py, made in the work directory)")
    p.add_argument("--work-dir", default=None,
                   help="where runs write checkpoints and logs (default: a temporary directory, "
                        "removed at the end)")
    p.add_argument("--train-iters", type=_positive(int), default=6, help="steps of every run")
    p.add_argument("--save-interval", type=_positive(int), default=2, help="steps between checkpoints")
    p.add_argument("--step-timeout-minutes", type=float, default=0.25,
                   help="watchdog timeout of the runs (pretrain_gpt.py flag)")
    p.add_argument("--jobs", type=_positive(int), default=1,
                   help="trials run at the same time (each is two processes)")
    return p


def check_args(args) -> None:
    if args.data_path is not None:
        for ext in (".bin", ".idx"):
            if not os.path.isfile(args.data_path + ext):
                fail(f"--data-path: {args.data_path + ext} does not exist")
    if args.save_interval >= args.train_iters:
        fail(f"--save-interval {args.save_interval} must be below --train-iters {args.train_iters} "
             "(a fault needs a checkpoint to resume from)")
    if not args.step_timeout_minutes > 0:
        fail(f"--step-timeout-minutes must be > 0, got {args.step_timeout_minutes}")
    if args.output is not None:
        d = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(d):
            fail(f"--output: directory {d} does not exist")
        if not os.access(d, os.W_OK):
            fail(f"--output: directory {d} is not writable")
    if args.work_dir is not None and os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
        fail(f"--work-dir: {args.work_dir} is not a directory")


# ---- one run of two ranks ---------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, port: int, extra: Dict[str, str]) -> Dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", RANK=str(rank),
             LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
             SB_TEST_DET_TIMES="1")
    for k in ("SB_TEST_KILL", "SB_TEST_HANG", "SB_TEST_DROP_SB_STATE"):
        e.pop(k, None)
    e.update(extra)
    return e


def run_pair(flags: List[str], out_dir: str, extra: Dict[str, str], limit_s: float,
             after_first_s: Optional[float] = None) -> dict:
    """Start ranks 0 and 1 of the worker; wait. ``after_first_s``: once one rank has
    exited, the other gets this long before it counts as hung and is killed.

    Returns per-rank return codes and exit times (s from start), whether a rank was
    killed by the harness, and each rank's stderr."""
    os.makedirs(out_dir, exist_ok=True)
    port = _port()
    procs, files = [], []
    t0 = time.monotonic()
    for rank in range(2):
        out = open(os.path.join(out_dir, f"rank{rank}.out"), "w")
        err = open(os.path.join(out_dir, f"rank{rank}.err"), "w")
        files += [out, err]
        procs.append(forklaunch.popen([sys.executable, WORKER, *flags], cwd=REPO,
                                      env=_env(rank, port, {"SB_TEST_DUMP": os.path.join(out_dir, "dump"),
                                                            **extra}),
                                      stdout=out, stderr=err))
    ended: List[Optional[float]] = [None, None]
    hung = [False, False]
    try:
        while None in ended:
            now = time.monotonic() - t0
            for r, p in enumerate(procs):
                if ended[r] is None and p.poll() is not None:
                    ended[r] = now
            done = [e for e in ended if e is not None]
            for r, p in enumerate(procs):
                if ended[r] is not None:
                    continue
                late = (after_first_s is not None and done and now - done[0] > after_first_s) or now > limit_s
                if late:
                    hung[r] = True
                    p.kill()
                    p.wait()
                    ended[r] = time.monotonic() - t0
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
    return {"rc": [p.returncode for p in procs], "ended_s": ended, "hung": hung,
            "stderr": [open(os.path.join(out_dir, f"rank{r}.err")).read() for r in range(2)],
            "dump": os.path.join(out_dir, "dump")}


def read_dump(dump: str) -> tuple:
    """({rank: {iteration: step dict}}, {rank: loaded iteration or None})."""
    steps: Dict[int, dict] = {0: {}, 1: {}}
    loaded: Dict[int, Optional[int]] = {0: None, 1: None}
    for r in (0, 1):
        path = os.path.join(dump, f"rank{r}.jsonl")
        if not os.path.isfile(path):
            continue
        for line in open(path):
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by the kill
                continue
            if "loaded" in row:
                loaded[r] = row["loaded"]
            elif "iteration" in row:
                steps[r][row["iteration"]] = row
    return steps, loaded


def error_lines(stderr: str) -> List[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("pretrain_gpt.py: error:")]


# ---- trials ----------------------------------------------------------------------------

def fault_point(rng: random.Random, train_iters: int, save_interval: int) -> dict:
    """Victim rank, phase, step and occurrence of one trial."""
    phase = rng.choice(PHASES)
    if phase == "checkpoint":
        saves = list(range(save_interval, train_iters + 1, save_interval))
        if train_iters not in saves:
            saves.append(train_iters)
        step = rng.choice(saves)
    else:
        step = rng.randint(1, train_iters)
    nth = {"forward": rng.randint(1, MICROBATCHES), "p2p": rng.randint(1, 3)}.get(phase, 1)
    return {"rank": rng.randint(0, 1), "phase": phase, "step": step, "nth": nth}


def checkpoints(root: str) -> dict:
    """{iteration: None if intact else why} of every ``iter_*`` directory, the tracker,
    and the leftover ``.tmp-`` directories of interrupted saves."""
    from megatron.training import checkpointing as ckpt

    state = {i: ckpt.check_checkpoint(ckpt.iter_dir(root, i), i) for i in ckpt.list_iterations(root)}
    try:
        tracker = ckpt.read_tracker(root) if os.path.isdir(root) else None
    except ValueError as e:
        tracker = f"bad: {e}"
    tmp = sorted(n for n in os.listdir(root) if ".tmp-" in n) if os.path.isdir(root) else []
    return {"iterations": state, "tracker": tracker, "tmp_dirs": tmp}


def compare(ref: Dict[int, dict], got: Dict[int, dict], iterations: List[int]) -> Optional[str]:
    """None if ``got`` has every iteration in ``iterations`` equal to ``ref`` (both ranks),
    else the first difference."""
    for r in (0, 1):
        for it in iterations:
            if it not in got[r]:
                return f"rank {r} has no step {it}"
            for key in COMPARED:
                if got[r][it][key] != ref[r][it][key]:
                    return f"rank {r} step {it}: {key} differs"
    return None


def run_trial(args, base: List[str], ref: Dict[int, dict], trial: int, work: str) -> dict:
    rng = random.Random(f"{args.seed}/{trial}")
    point = fault_point(rng, args.train_iters, args.save_interval)
    t_start = time.monotonic()
    d = os.path.join(work, f"trial{trial:03d}")
    save = os.path.join(d, "ckpt")
    os.makedirs(save)  # --load == --save on an empty directory: a fresh start that can resume
    flags = [*base, "--save", save, "--load", save, "--save-interval", str(args.save_interval)]
    watchdog_s = args.step_timeout_minutes * 60
    kill = f"{point['rank']}:{point['phase']}:{point['step']}:{point['nth']}"
    faulty = run_pair(flags, os.path.join(d, "faulty"), {"SB_TEST_KILL": kill}, limit_s=600,
                      after_first_s=watchdog_s + 60)
    victim, survivor = point["rank"], 1 - point["rank"]
    hit = faulty["rc"][victim] == -9
    out = {"trial": trial, "fault": point, "hit": hit, "rc": faulty["rc"]}
    if hit:
        gap = faulty["ended_s"][survivor] - faulty["ended_s"][victim]
        lines = error_lines(faulty["stderr"][survivor])
        out.update(survivor_exit_s=round(gap, 2), survivor_hung=faulty["hung"][survivor],
                   survivor_error=lines[0] if len(lines) == 1 else lines,
                   survivor_traceback="Traceback" in faulty["stderr"][survivor])
    before = checkpoints(save)
    out["checkpoints"] = {"intact": sorted(i for i, why in before["iterations"].items() if why is None),
                          "damaged": {str(i): why for i, why in before["iterations"].items() if why},
                          "tracker": before["tracker"], "tmp_dirs": len(before["tmp_dirs"])}
    newest = max(out["checkpoints"]["intact"], default=None)
    resumed = run_pair(flags, os.path.join(d, "resume"), {}, limit_s=600)
    steps, loaded = read_dump(resumed["dump"])
    out["resume_rc"] = resumed["rc"]
    out["resume_hung"] = any(resumed["hung"])
    out["loaded"] = loaded[0]
    out["loaded_intact"] = loaded[0] is None or before["iterations"].get(loaded[0]) is None
    start = loaded[0] or 0
    expected = list(range(start + 1, args.train_iters + 1))
    mismatch = (f"resume failed: rc {resumed['rc']}" if resumed["rc"] != [0, 0] else
                f"loaded {loaded} but the newest intact checkpoint is {newest}" if loaded != {0: newest, 1: newest}
                else compare(ref, steps, expected))
    out.update(resumed_steps=expected, exact=mismatch is None, mismatch=mismatch)
    out["hang"] = bool(out.get("survivor_hung")) or out["resume_hung"]
    out["passed"] = (hit and not out["hang"] and out["loaded_intact"] and out["exact"]
                     and faulty["rc"][survivor] not in (0, None))
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def summarize(args, trials: List[dict], ref_s: float, wall_s: float) -> dict:
    phases = {p: sum(1 for t in trials if t["fault"]["phase"] == p and t["hit"]) for p in PHASES}
    gaps = [t["survivor_exit_s"] for t in trials if "survivor_exit_s" in t]
    return {
        "trials": len(trials), "seed": args.seed, "passed": sum(t["passed"] for t in trials),
        "faults_hit": sum(t["hit"] for t in trials), "hit_by_phase": phases,
        "hangs": sum(t["hang"] for t in trials),
        "damaged_loaded": sum(not t["loaded_intact"] for t in trials),
        "exact_resumes": sum(t["exact"] for t in trials),
        "survivor_exit_s_max": max(gaps) if gaps else None,
        "survivor_one_error_line": sum(isinstance(t.get("survivor_error"), str) for t in trials),
        "config": {"train_iters": args.train_iters, "save_interval": args.save_interval,
                   "step_timeout_minutes": args.step_timeout_minutes, "flags": MODEL,
                   "microbatches": MICROBATCHES},
        "reference_run_s": round(ref_s, 1), "wall_s": round(wall_s, 1), "per_trial": trials,
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    t0 = time.monotonic()
    own_work = args.work_dir is None
    work = tempfile.mkdtemp(prefix="fault_trials-") if own_work else args.work_dir
    os.makedirs(work, exist_ok=True)
    try:
        data = args.data_path
        if data is None:
            data = os.path.join(work, "corpus", "tiny")
            os.makedirs(os.path.dirname(data), exist_ok=True)
            made = subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_corpus.py"),
                                   "--output-prefix", data, "--num-docs", "300", "--max-length", "384",
                                   "--quantile", "0.99"], cwd=REPO, capture_output=True, text=True)
            if made.returncode != 0:
                fail(f"making the corpus failed: {(made.stderr.strip().splitlines() or ['?'])[-1]}", 1)
        base = [*MODEL, "--data-path", data, "--train-iters", str(args.train_iters),
                "--step-timeout-minutes", f"{args.step_timeout_minutes:g}",
                "--distributed-timeout-minutes", "3"]
        ref_save = os.path.join(work, "reference", "ckpt")
        ref = run_pair([*base, "--save", ref_save, "--save-interval", str(args.save_interval)],
                       os.path.join(work, "reference"), {}, limit_s=600)
        if ref["rc"] != [0, 0]:
            lines = [ln for e in ref["stderr"] for ln in e.splitlines() if "error" in ln.lower()]
            fail(f"the reference run failed (rc {ref['rc']}): {(lines or ['see ' + work])[0]}", 1)
        ref_steps, _ = read_dump(ref["dump"])
        ref_s = max(ref["ended_s"])
        from tqdm import tqdm

        trials = []
        bar = tqdm(total=args.trials, desc="fault trials", unit="trial", file=sys.stderr, disable=None)
        with ThreadPoolExecutor(args.jobs) as pool:
            for t in pool.map(lambda i: run_trial(args, base, ref_steps, i, work), range(args.trials)):
                trials.append(t)
                bar.update(1)
                bar.set_postfix(passed=f"{sum(t['passed'] for t in trials)}/{len(trials)}")
        bar.close()
        summary = summarize(args, trials, ref_s, time.monotonic() - t0)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    if args.output:
        from sparsebalance.io import atomic_write_text

        atomic_write_text(args.output, json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for t in trials:
            f = t["fault"]
            print(f"trial {t['trial']:3d}: rank {f['rank']} killed in {f['phase']:<10} step {f['step']} "
                  f"#{f['nth']}: hit {t['hit']}, survivor exit {t.get('survivor_exit_s', '-')} s, "
                  f"loaded {t['loaded']}, exact {t['exact']}{'' if t['passed'] else ' FAILED: ' + str(t['mismatch'])}")
        print(f"{summary['passed']}/{summary['trials']} passed | hangs {summary['hangs']} | "
              f"damaged loaded {summary['damaged_loaded']} | exact resumes {summary['exact_resumes']} | "
              f"hit by phase {summary['hit_by_phase']} | {summary['wall_s']:.0f} s")
    return 0 if summary["passed"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
