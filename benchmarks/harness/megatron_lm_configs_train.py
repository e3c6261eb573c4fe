"""Train every Megatron-LM GPT functional-test config ``pretrain_gpt.py`` accepts, 2 iterations on CPU.

The configs harness (:mod:`benchmarks.harness.megatron_lm_configs`) judges each config's whole
line; this one runs it: each config accepted with ``--cuda`` (as on the target), minus the flags
refused here for missing hardware (``--bf16``, ``--fp16``, ``nccl``: the CPU trains in fp32),
with its sizes shrunk (:func:`shrink`: hidden size 8 per head and at least 64, sequence 128,
micro-batches of one sequence, as many per data-parallel rank as the config has up to 2 x PP,
2 iterations, 1 evaluation batch; layers, heads, parallel layout and every other flag as the config gives them), is
launched as ``torchrun --nproc-per-node N pretrain_gpt.py ...`` on the config's world of ranks
(:func:`~benchmarks.harness.megatron_lm_configs.world_size`; ``--max-data-parallel`` caps its
data-parallel part), on a small indexed dataset and
the stand-in GPT-2 vocabulary of the configs harness. A config passes when every rank exits 0
and rank 0's summary has 2 iterations of finite loss; else its one-line reason (the last error
line). Configs whose shrunk lines are identical (``_1node`` twins, logging-only differences)
run once and share the verdict. The ranks are warm processes (``tests/_world.py``: each job
runs the script as torchrun runs it, with torch and megatron-core imported once, not per
rank per config); ``--cold`` starts real torchrun processes instead (a config with
``--wandb-project`` always gets them: W&B's process-wide service does not survive a second run in
one process). Prints JSON (and writes
it to ``--out``)::

    .venv/bin/python -m benchmarks.harness.megatron_lm_configs_train --megatron-lm /tmp/Megatron-LM \\
        --out results/megatron_lm_configs_train.json          # ~1 h on 2 CPU cores
    .venv/bin/python -m benchmarks.harness.megatron_lm_configs_train --megatron-lm /tmp/Megatron-LM \\
        --only gpt3_mcore_te_tp2_pp2_mla                       # one config
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from benchmarks.harness.megatron_lm_configs import NOT_TRAINING, _dataset, config_argv, config_flags, world_size

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 128
"""Shrunk --seq-length (and --max-position-embeddings)."""
ITERS = 2


def shrink(flags: list, iters: int = ITERS, dp: int = 1, dp_given: int = 1) -> list:
    """The config's ``[(flag, values)]`` at CPU sizes (module docstring) for ``dp`` data-parallel
    ranks where it was given ``dp_given``; other flags unchanged. Micro-batches of one sequence;
    per data-parallel rank as many micro-batches as the config has, at most 2 x PP (what the
    pipeline schedules need to fill and drain)."""
    given = dict(flags)

    def num(flag, default):
        try:
            return int(float((given.get(flag) or [default])[0]))
        except ValueError:
            return int(default)

    heads = num("--num-attention-heads", 8)
    hidden = heads * max(8, math.ceil(64 / heads))
    mbs, gbs = num("--micro-batch-size", 1), given.get("--global-batch-size")
    new = {
        "--hidden-size": [str(hidden)],
        "--seq-length": [str(SEQ)],
        "--micro-batch-size": ["1"],
        "--eval-iters": ["1"],
    }
    pp = num("--pipeline-model-parallel-size", 1)

    def batch(sequences: int) -> int:  # the config's batch at CPU size (module docstring)
        return dp * min(max(1, sequences // (mbs * dp_given)), 2 * pp)

    first = "1"  # the step's batch (sequences) at CPU size
    if gbs is not None and "$" not in gbs[0]:
        first = str(batch(int(gbs[0])))
        new["--global-batch-size"] = [first]
    schedule = given.get("--step-batch-size-schedule")
    if schedule and not any("$" in w for w in schedule):
        # each entry's batch shrunk alike (its thresholds, in tokens, are not reached in 2 iterations)
        words = [w.partition(":") for w in " ".join(schedule).replace(",", " ").split()]
        new["--step-batch-size-schedule"] = [f"{at}:{batch(int(float(size)))}" for at, _, size in words]
        first = new["--step-batch-size-schedule"][0].partition(":")[2]  # sorted: the 0 entry leads
    for flag, value in (("--ffn-hidden-size", 2 * hidden), ("--kv-channels", hidden // heads),
                        ("--max-position-embeddings", SEQ), ("--decoder-seq-length", SEQ)):
        if flag in given:
            new[flag] = [str(value)]
    if "--train-samples" in given:
        new["--train-samples"] = [str(iters * int(first))]
    else:
        new["--train-iters"] = [str(iters)]
    out = [(f, new.pop(f, v)) for f, v in flags]
    return out + sorted(new.items())


def tokenizer_stand_in(flags: list) -> Optional[str]:
    """Write a small stand-in where the config's ``--tokenizer-model`` points (the cluster has the
    real one): a byte-level BPE ``tokenizer.json`` for HuggingFaceTokenizer. Returns why the
    config cannot run here instead, or None: SentencePiece models need the ``sentencepiece``
    package (a stand-in model is written with it where it is installed)."""
    given = dict(flags)
    kind, model = (given.get("--tokenizer-type") or [None])[0], (given.get("--tokenizer-model") or [None])[0]
    if model is None:
        return None
    if kind == "HuggingFaceTokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        from benchmarks.harness.megatron_lm_configs import FIM_TOKENS

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(alphabet)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(list(FIM_TOKENS))
        os.makedirs(model, exist_ok=True)
        tok.save(os.path.join(model, "tokenizer.json"))
        return None
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        try:
            import sentencepiece
        except ImportError:
            return f"not run here: --tokenizer-type {kind} needs the sentencepiece package, not installed here"
        import random

        os.makedirs(os.path.dirname(model), exist_ok=True)
        rng = random.Random(0)  # words of 26 letters: enough distinct pieces for a 200-piece vocabulary
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                 for _ in range(500)]
        text = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(400)]
        prefix = model + ".stand_in"  # the trainer writes PREFIX.model / .vocab; the config names the file
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=prefix, vocab_size=200)
        os.replace(prefix + ".model", model)
        os.remove(prefix + ".vocab")
    return None


def _sized(flags: list, runnable: list, iters: int, max_dp: int) -> tuple:
    """(ranks, shrunk flags) of a config with at most ``max_dp`` data-parallel ranks."""
    nproc, full = cpu_world(flags, max_dp), world_size(flags)
    model = full // _data_parallel(flags, full)
    return nproc, shrink(runnable, iters, nproc // model, full // model)


def _data_parallel(flags: list, world: int) -> int:
    """``world`` / the config's TP x PP x CP."""
    given = dict(flags)
    model = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        try:
            model *= int((given.get(flag) or ["1"])[0])
        except ValueError:
            pass
    return world // model


def cpu_world(flags: list, max_dp: int) -> int:
    """The config's world (:func:`~benchmarks.harness.megatron_lm_configs.world_size`) with at
    most ``max_dp`` data-parallel ranks: the model-parallel layout (TP x PP x CP) as given; DP
    is a size like the batch (data-parallel training equals one rank's on the same data)."""
    dp = _data_parallel(flags, world_size(flags))
    return world_size(flags) // dp * max(d for d in range(1, min(dp, max_dp) + 1) if dp % d == 0)


def accepted_configs(root: str) -> list:
    """``[(name, runnable flags)]`` of the training configs accepted whole with ``--cuda``."""
    import yaml

    from megatron.training.launch_check import classify, judge_line

    scratch = tempfile.mkdtemp(prefix="megatron_lm_configs_judge_")
    data_prefix = _dataset(scratch)
    out = []
    for path in sorted(glob.glob(os.path.join(root, "tests", "functional_tests", "test_cases", "gpt", "*",
                                              "model_config.yaml"))):
        with open(path, encoding="utf-8") as f:
            model_args = (yaml.safe_load(f) or {}).get("MODEL_ARGS") or {}
        if not model_args or any(k in model_args for k in NOT_TRAINING):
            continue
        flags = config_flags(model_args)
        if judge_line(config_argv(flags, scratch, data_prefix), cuda=True, te=True,
                      world_size=world_size(flags)) is not None:
            continue
        runnable = [(r["flag"], r["values"]) for r in classify(flags, cuda=False, te=False)
                    if r["status"] != "hardware"]
        out.append((os.path.basename(os.path.dirname(path)), flags, runnable))
    shutil.rmtree(scratch, ignore_errors=True)
    return out


def _stops_by_design(flags: list, reason: str) -> bool:
    """A config that injects a persistent error (``--error-injection-type persistent_error``
    under ``--rerun-mode validate_results``) is meant to stop when a re-run reproduces it
    (Megatron-LM saves and exits for a resume elsewhere; this driver stops in one line)."""
    given = dict(flags)
    return (given.get("--error-injection-type") or [None])[0] == "persistent_error" and "reproduced" in reason


def _verdict(returncode: int, stdout: str, stderr: str, iters: int) -> tuple:
    """(passed, reason) of one run."""
    if returncode:
        lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.search(r"error|Error|refused|Traceback", ln)]
        return False, (errors[-1] if errors else lines[-1] if lines else f"exit {returncode}")[:300]
    found = [ln for ln in stdout.splitlines() if "SUMMARY_JSON " in ln]
    if not found:
        return False, "no SUMMARY_JSON line from rank 0"
    summary = json.loads(found[-1].split("SUMMARY_JSON ", 1)[1])
    losses = [x for x in summary.get("losses") or [] if x is not None]
    if len(losses) != iters or not all(math.isfinite(x) for x in losses):
        return False, f"losses {summary.get('losses')} (want {iters} finite)"
    return True, "losses " + ", ".join(f"{x:.4f}" for x in losses)


class _Launcher:
    """Runs one job: warm ranks (tests/_world.py) or a cold torchrun."""

    def __init__(self, cold: bool, io_dir: str, timeout: float):
        self.cold, self.timeout, self.world = cold, timeout, None
        # W&B offline: the configs' --wandb-project logs where their cluster has a key; here the
        # run's files are written locally (the stand-in, as for their tokenizers)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", WANDB_MODE="offline")
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self.env = env
        if not cold:
            sys.path.insert(0, os.path.join(ROOT, "tests"))
            from _world import World

            self.world = World(io_dir, env)

    def run(self, argv: list, nproc: int) -> tuple:
        script = os.path.join(ROOT, "pretrain_gpt.py")
        # W&B keeps a process-wide service connection that a second run in the same warm rank
        # finds closed (MailboxClosedError): a config that logs to W&B gets fresh processes
        warm = self.world is not None and "--wandb-project" not in argv
        try:
            if warm:
                job = self.world.launch(script, argv, nproc=nproc, timeout=self.timeout)
                return job.returncode, job.stdout, job.stderr
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                   script, *argv]
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=self.timeout)
            return proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            return 124, "", f"timed out after {self.timeout:.0f} s"

    def close(self):
        if self.world is not None:
            self.world.close(kill=True)


def measure(root: str, only=None, cold: bool = False, timeout: float = 300, iters: int = ITERS,
            log=None, max_dp: int = 8, budget_s: Optional[float] = None, previous: Optional[dict] = None,
            on_row=None) -> dict:
    """The check over the accepted configs (module docstring); ``previous``: config -> its row of
    an earlier run, whose verdict is kept (not run again) unless it was not run; ``on_row(rows)``
    after each config (a long run's partial result)."""
    previous = previous or {}
    from megatron.training.compat import split_script_flags
    from megatron.training.launch_check import judge_line

    configs = accepted_configs(root)
    if only:
        configs = [c for c in configs if c[0] in only]
    scratch = tempfile.mkdtemp(prefix="megatron_lm_configs_train_")
    data_prefix = _dataset(scratch)
    launcher = _Launcher(cold, scratch, timeout)
    runs, rows, began = {}, [], time.monotonic()
    keyed = []
    for name, flags, runnable in configs:
        nproc, small = _sized(flags, runnable, iters, max_dp)
        if max_dp < world_size(flags) and judge_line(config_argv(small, os.path.join(scratch, "judge"), data_prefix),
                                                     cuda=False, te=False, world_size=nproc) is not None:
            # a rule needs the config's own DP (e.g. --num-distributed-optimizer-instances)
            nproc, small = _sized(flags, runnable, iters, world_size(flags))
        keyed.append((name, nproc, small, (nproc, tuple((f, tuple(v)) for f, v in small))))
    # the lines most configs share first, then the smaller worlds (a --budget-s run covers most)
    share = {}
    for *_, key in keyed:
        share[key] = share.get(key, 0) + 1
    keyed.sort(key=lambda c: (-share[c[3]], c[1], c[0]))
    try:
        for name, nproc, small, key in keyed:
            if key not in runs and budget_s is not None and time.monotonic() - began > budget_s:
                runs[key] = {"passed": None, "reason": f"not run: --budget-s {budget_s:.0f} spent", "wall_s": 0.0,
                             "first": name}
            if key not in runs and name in previous and previous[name]["passed"] in (True, "stopped"):
                kept = previous[name]["reason"].split(" (--resume)")[0]  # marked once, however many resumes
                runs[key] = dict(previous[name], first=name, reason=kept + " (--resume)")
            if key not in runs:
                run_dir = os.path.join(scratch, f"run{len(runs)}")
                argv = config_argv(small, run_dir, data_prefix)
                start = time.monotonic()
                # the trainer's own parse and validation first, as on this machine (no launch
                # for a line it refuses: a failed job restarts every warm rank)
                reason = tokenizer_stand_in(split_script_flags(argv)) or \
                    judge_line(argv, cuda=False, te=False, world_size=nproc)
                if reason is None:
                    passed, reason = _verdict(*launcher.run(argv, nproc), iters)
                    if not passed and _stops_by_design(small, reason):
                        passed, reason = "stopped", "stopped as the config means: " + reason
                else:
                    passed = False
                runs[key] = {"passed": passed, "reason": reason, "wall_s": round(time.monotonic() - start, 1),
                             "first": name}
                shutil.rmtree(run_dir, ignore_errors=True)
            r = runs[key]
            rows.append({"config": name, "world_size": nproc, "passed": r["passed"], "reason": r["reason"],
                         "same_line_as": None if r["first"] == name else r["first"], "wall_s": r["wall_s"]})
            if on_row:
                on_row(rows)
            if log:
                word = {True: "PASS", False: "FAIL", None: "SKIP", "stopped": "STOP"}[r["passed"]]
                log(f"{word} {name} (x{nproc}, {r['wall_s']} s): {r['reason']}")
    finally:
        launcher.close()
        shutil.rmtree(scratch, ignore_errors=True)
    passed = sum(r["passed"] is True for r in rows)
    not_run = sum(r["passed"] is None for r in rows)
    stopped = sum(r["passed"] == "stopped" for r in rows)
    return {"accepted_configs": len(rows), "trained": passed, "failed": len(rows) - passed - not_run - stopped,
            "stopped_as_the_config_means": stopped, "not_run": not_run, "distinct_lines": len(runs),
            "iterations": iters, "seq_length": SEQ,
            "max_data_parallel": max_dp, "wall_s": round(time.monotonic() - began),
            "launcher": "torchrun" if cold else "warm ranks (tests/_world.py); torchrun for --wandb-project configs",
            "failures": [{"config": r["config"], "reason": r["reason"]} for r in rows if r["passed"] is False],
            "configs": rows}


def main(argv=None) -> None:
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="megatron_lm_configs_train.py", description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, metavar="DIR", help="a Megatron-LM checkout")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="these configs (directory names) only")
    p.add_argument("--train-iters", type=int, default=ITERS, metavar="N", help="iterations per config (default 2)")
    p.add_argument("--timeout-s", type=float, default=300, help="per run (default 300)")
    p.add_argument("--cold", action="store_true", help="real torchrun processes instead of warm ranks")
    p.add_argument("--max-data-parallel", type=int, default=8, metavar="N",
                   help="at most N data-parallel ranks per config (default 8: the configs' node of 8 ranks)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="launch no new run after this many seconds (the rest: not run)")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the JSON here")
    p.add_argument("--resume", default=None, metavar="JSON",
                   help="an earlier run's JSON: keep its passes (and intended stops), run the other configs")
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.megatron_lm, "tests", "functional_tests")):
        p.error(f"--megatron-lm {a.megatron_lm}: no tests/functional_tests there (not a Megatron-LM checkout)")
    for flag, value in (("--train-iters", a.train_iters), ("--max-data-parallel", a.max_data_parallel)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    previous = None
    if a.resume:
        try:
            with open(a.resume, encoding="utf-8") as f:
                previous = {r["config"]: r for r in json.load(f)["configs"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--resume {a.resume}: not a JSON this harness wrote ({e})")
    def write(result):
        if a.out:
            with open(a.out + ".tmp", "w", encoding="utf-8") as f:
                f.write(json.dumps(result, indent=1) + "\n")
            os.replace(a.out + ".tmp", a.out)

    result = measure(a.megatron_lm, a.only, a.cold, a.timeout_s, a.train_iters,
                     log=lambda line: print(line, file=sys.stderr, flush=True), max_dp=a.max_data_parallel,
                     budget_s=a.budget_s, previous=previous,
                     on_row=lambda rows: write({"partial": True, "configs": rows}))
    write(result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
