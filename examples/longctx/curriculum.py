"""Stage 0 of the long-context recipe: the shared dense base model, trained as a
curriculum of stages read from a JSON file (``stages.json``: the lineage measured
on a 2-core CPU, docs/longctx_findings.md).

Each stage trains dense for its own wall-clock budget on its own data mix, starting
from the previous stage's weights with a fresh optimizer (the first from a fresh
init), and is probed at the end on held-out samples (exact match, answer-token and
value-digit accuracy under teacher forcing). The last stage's run is the base every
arm starts from. Everything is resumable: a stage whose budget is spent is skipped,
one cut short resumes from its own checkpoint for the rest of its budget, and a
stage's data is built once.

    .venv/bin/python examples/longctx/curriculum.py --stages examples/longctx/stages.json \\
        --data-dir data/longctx/curriculum --runs-dir runs/longctx/curriculum
    ... --status          what is done, what is left, the probes so far
    ... --final-dir       print the base's run directory (the last stage's)

Layout: ``DATA_DIR/NAME/{train.jsonl,train_text_document.*}``, ``RUNS_DIR/NAME/``
(``ckpt/``, ``train.log``, ``train_meta.json``, ``model_flags.txt`` from train_arm.sh,
``probe.json`` from benchmarks/eval_longctx.py). The model's shape and the process layout
come from config.sh (NUM_LAYERS, HIDDEN, ...), the schedule from the stage file.

Stage file::

    {"stages": [
      {"name": "A", "lr": 3e-3, "budget_s": 1930, "seq_length": 1024, "global_batch": 8,
       "mixes": [{"tasks": "repeat", "lengths": "256,512", "docs": 40000, "seed": 5,
                  "copy_chars": 32}],
       "probe": {"tasks": "repeat", "lengths": "512,1024", "samples": 20, "seed": 78},
       "note": "what this stage is for"}, ...]}

``loss`` ("answer", the default, or "all") picks answer-only or plain LM loss. A mix may
set ``copy_chars`` and ``value_digits`` (a needle value's digits, 7 by default), the task
generator knobs of benchmarks/make_longctx_data.py. A mix's
``lengths`` (a comma list or a JSON list) is cycled over its documents: repeat a length
to weight it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
from typing import NoReturn

PROG = "curriculum.py"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
from megatron.training.arguments import usage_error  # noqa: E402  (one error line, exit code)

# A stage cut short by less than this (or half its budget) is done: a launch costs
# ~30 s of start-up.
SLACK_S = 60.0

STAGE_KEYS = {"name", "lr", "budget_s", "seq_length", "global_batch", "mixes", "probe", "loss", "note"}
MIX_KEYS = {"tasks", "lengths", "docs", "seed", "copy_chars", "value_digits"}
TASK_KNOBS = ("copy_chars", "value_digits")
"""Optional mix keys passed to benchmarks/make_longctx_data.py as ``--copy-chars`` / ``--value-digits``."""
PROBE_KEYS = {"tasks", "lengths", "samples", "seed"}


class StageError(ValueError):
    pass


def fail(message: str, code: int = 2) -> NoReturn:
    usage_error(message, prog=PROG, code=code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def _lengths(where: str, value) -> list[int]:
    """A comma list ("256,512") or a JSON list of integers."""
    parts = value if isinstance(value, list) else str(value).split(",")
    try:
        if any(isinstance(x, (bool, float)) for x in parts):
            raise ValueError
        out = [int(x) for x in parts]
    except (TypeError, ValueError):
        raise StageError(f"{where}: lengths must be a comma list of integers, got {value!r}") from None
    if not out or min(out) < 1:
        raise StageError(f"{where}: lengths must be positive, got {value!r}")
    return out


def _number(where: str, d: dict, key: str, kind, low) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v)) or v < low:
        raise StageError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'} >= {low}, got {v!r}")
    return kind(v)


def _tasks(where: str, d: dict) -> str:
    if not isinstance(d.get("tasks"), str) or not d["tasks"]:
        raise StageError(f"{where}: tasks must be a comma list of task names")
    return d["tasks"]


def _check_samples(where: str, tasks: str, lengths: list[int], knobs: dict | None = None) -> None:
    """Every (task, length) of a mix or probe can be generated: a typo or a length too
    short for a task fails here, not hours later when the stage's turn comes."""
    from benchmarks.harness.longctx.tasks import TaskConfig, generate

    cfg = TaskConfig(**(knobs or {}))
    for task in tasks.split(","):
        for n in sorted(set(lengths)):
            try:
                generate(task, n, seed=0, config=cfg)
            except ValueError as e:
                raise StageError(f"{where}: {e}") from None


def _unknown(where: str, d: dict, allowed: set) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise StageError(f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(allowed))})")


def parse_stages(spec) -> list[dict]:
    """Validate a stage file's content; returns the stages with defaults filled in.
    Raises StageError naming the first problem."""
    if not isinstance(spec, dict) or not isinstance(spec.get("stages"), list) or not spec["stages"]:
        raise StageError('the file must be a JSON object {"stages": [...]} with at least one stage')
    _unknown("the file", spec, {"stages", "description"})
    stages, names = [], set()
    for i, st in enumerate(spec["stages"]):
        if not isinstance(st, dict):
            raise StageError(f"stage {i}: must be an object")
        name = st.get("name")
        where = f"stage {name!r}" if isinstance(name, str) else f"stage {i}"
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise StageError(f"{where}: name must be letters, digits, '_', '.' or '-'")
        if name in names:
            raise StageError(f"{where}: the name is used twice")
        names.add(name)
        _unknown(where, st, STAGE_KEYS)
        out = {"name": name, "lr": _number(where, st, "lr", float, 1e-12),
               "budget_s": _number(where, st, "budget_s", float, 1),
               "seq_length": _number(where, st, "seq_length", int, 16),
               "global_batch": _number(where, st, "global_batch", int, 2),  # PP=2 needs >= 2
               "loss": st.get("loss", "answer"), "note": st.get("note", "")}
        if out["loss"] not in ("answer", "all"):
            raise StageError(f"{where}: loss must be 'answer' or 'all', got {out['loss']!r}")
        mixes = st.get("mixes")
        if not isinstance(mixes, list) or not mixes:
            raise StageError(f"{where}: mixes must be a non-empty list")
        out["mixes"] = []
        for j, m in enumerate(mixes):
            mw = f"{where} mix {j}"
            if not isinstance(m, dict):
                raise StageError(f"{mw}: must be an object")
            _unknown(mw, m, MIX_KEYS)
            tasks = _tasks(mw, m)
            lengths = _lengths(mw, m.get("lengths"))
            if max(lengths) > out["seq_length"]:
                raise StageError(f"{mw}: documents of {max(lengths)} tokens do not fit seq_length {out['seq_length']}")
            mix = {"tasks": tasks, "lengths": ",".join(map(str, lengths)),
                   "docs": _number(mw, m, "docs", int, 1), "seed": _number(mw, m, "seed", int, 0)}
            for knob in TASK_KNOBS:
                if knob in m:
                    mix[knob] = _number(mw, m, knob, int, 1)
            _check_samples(mw, tasks, lengths, {k: mix[k] for k in TASK_KNOBS if k in mix})
            out["mixes"].append(mix)
        probe = st.get("probe")
        if probe is not None:
            pw = f"{where} probe"
            if not isinstance(probe, dict):
                raise StageError(f"{pw}: must be an object")
            _unknown(pw, probe, PROBE_KEYS)
            tasks, lengths = _tasks(pw, probe), _lengths(pw, probe.get("lengths"))
            _check_samples(pw, tasks, lengths)
            out["probe"] = {"tasks": tasks, "lengths": ",".join(map(str, lengths)),
                            "samples": _number(pw, probe, "samples", int, 1),
                            "seed": _number(pw, probe, "seed", int, 0)}
        stages.append(out)
    return stages


def load_stages(path: str) -> list[dict]:
    try:
        with open(path) as f:
            spec = json.load(f)
    except OSError as e:
        raise StageError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise StageError(f"{path} is not valid JSON: {e}") from None
    return parse_stages(spec)


def _meta(run: str) -> dict | None:
    try:
        with open(os.path.join(run, "train_meta.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def spent_s(run: str) -> float:
    """Wall clock the stage's run has trained so far (all launches)."""
    meta = _meta(run)
    return float(meta["wall_clock_s"]) if meta else 0.0


def remaining_s(stage: dict, run: str) -> float:
    """Budget left for a stage; 0 once less than SLACK_S (or half the budget) is left."""
    left = stage["budget_s"] - spent_s(run)
    return left if left > min(SLACK_S, stage["budget_s"] / 2) else 0.0


def build_data(stage: dict, data_dir: str, python: str) -> str:
    """The stage's tokenized mix (built once, atomically); returns its data prefix."""
    final = os.path.join(data_dir, stage["name"])
    prefix = os.path.join(final, "train_text_document")
    if os.path.isfile(prefix + ".idx"):
        return prefix
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    lines: list[str] = []
    for j, mix in enumerate(stage["mixes"]):
        out = os.path.join(tmp, f"mix{j}")
        cmd = [python, os.path.join(REPO, "benchmarks", "make_longctx_data.py"), "--output-dir", out,
               "--num-train-docs", str(mix["docs"]), "--train-tasks", mix["tasks"],
               "--train-lengths", mix["lengths"], "--max-tokens", str(stage["seq_length"]),
               "--filler-share", "0", "--eval-samples", "0", "--seed", str(mix["seed"])]
        for knob in TASK_KNOBS:
            if knob in mix:
                cmd += ["--" + knob.replace("_", "-"), str(mix[knob])]
        _run(cmd, f"building the data of stage {stage['name']} (mix {j})")
        with open(os.path.join(out, "train.jsonl")) as f:
            lines += f.readlines()
        shutil.rmtree(out)
    # One shuffled file, so that every micro-batch draws from every mix.
    random.Random(stage["mixes"][0]["seed"]).shuffle(lines)
    with open(os.path.join(tmp, "train.jsonl"), "w") as f:
        f.writelines(lines)
    _run([python, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", os.path.join(tmp, "train.jsonl"),
          "--output-prefix", os.path.join(tmp, "train"), "--loss-start-key", "loss_start"],
         f"tokenizing the data of stage {stage['name']}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return prefix


def _run(cmd: list[str], what: str, env: dict | None = None) -> None:
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        tail = p.stdout.strip().splitlines()[-1:] or ["(no output)"]
        fail(f"{what} failed (exit {p.returncode}): {tail[0]}", code=1)


def train(stage: dict, prev_run: str | None, run: str, data_prefix: str, budget_s: float) -> None:
    """One launch of train_arm.sh's stage mode: resumes the stage's own checkpoint if it
    has one, else starts from the previous stage's weights (fresh optimizer)."""
    env = dict(os.environ, STAGE_DIR=run, STAGE_DATA=data_prefix, STAGE_INIT=prev_run or "",
               STAGE_BUDGET_S=str(int(round(budget_s))), STAGE_GLOBAL_BATCH=str(stage["global_batch"]),
               LR=repr(stage["lr"]), SEQ_LENGTH=str(stage["seq_length"]),
               ANSWER_ONLY_LOSS="1" if stage["loss"] == "answer" else "0")
    p = subprocess.run(["bash", os.path.join(HERE, "train_arm.sh"), "stage"], env=env)
    if p.returncode != 0:
        fail(f"training stage {stage['name']} failed; see {run}/train.log", code=1)


def probe(stage: dict, run: str, python: str) -> dict:
    """Score the stage's checkpoint on its probe samples; writes RUN/probe.json."""
    spec = stage["probe"]
    out = os.path.join(run, "probe.json")
    with open(os.path.join(run, "model_flags.txt")) as f:
        flags = f.read().strip()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("EVAL_THREADS", "2"))
    _run([python, os.path.join(REPO, "benchmarks", "eval_longctx.py"), "--load", os.path.join(run, "ckpt"),
          "--train-args", flags, "--tasks", spec["tasks"], "--lengths", spec["lengths"],
          "--num-samples", str(spec["samples"]), "--seed", str(spec["seed"]), "--mode", "greedy",
          "--quiet", "--output", out], f"probing stage {stage['name']}", env=env)
    with open(out) as f:
        return json.load(f)


def probe_line(rep: dict) -> str:
    """``task@length exact/token/digits`` per probe cell."""
    cells = []
    for task, row in rep["accuracy"].items():
        for n, c in row.items():
            parts = [f"exact {c['accuracy']:.2f}"]
            parts += [f"{k.split('_')[0]} {c[k]:.2f}" for k in ("token_accuracy", "digit_accuracy") if k in c]
            cells.append(f"{task}@{n}: " + " ".join(parts))
    return "; ".join(cells)


def status(stages: list[dict], runs_dir: str) -> list[str]:
    lines = []
    for st in stages:
        run = os.path.join(runs_dir, st["name"])
        spent, meta = spent_s(run), _meta(run) or {}
        state = "done" if remaining_s(st, run) == 0 else ("partial" if spent else "to do")
        line = (f"{st['name']:>8}  {state:7} {spent:7.0f} / {st['budget_s']:.0f} s  "
                f"{meta.get('iterations') or 0:6} steps  LR {st['lr']:g}")
        p = os.path.join(run, "probe.json")
        if os.path.isfile(p):
            with open(p) as f:
                line += "  | " + probe_line(json.load(f))
        lines.append(line)
    return lines


def main(argv=None) -> int:
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default=os.path.join(HERE, "stages.json"), help="stage file (JSON)")
    ap.add_argument("--data-dir", default=os.path.join(REPO, "data", "longctx", "curriculum"))
    ap.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "longctx", "curriculum"))
    ap.add_argument("--python", default=os.environ.get("PYTHON", os.path.join(REPO, ".venv", "bin", "python")))
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--status", action="store_true", help="print each stage's state and probe; train nothing")
    what.add_argument("--final-dir", action="store_true", help="print the last stage's run directory")
    ap.add_argument("--until", metavar="NAME", help="stop after this stage")
    args = ap.parse_args(argv)
    try:
        stages = load_stages(args.stages)
    except StageError as e:
        fail(str(e))
    if args.until is not None and args.until not in {s["name"] for s in stages}:
        fail(f"--until: no stage named {args.until!r} in {args.stages}")
    if args.final_dir:
        print(os.path.join(os.path.abspath(args.runs_dir), stages[-1]["name"]))
        return 0
    if args.status:
        print("\n".join(status(stages, args.runs_dir)))
        return 0
    os.makedirs(args.data_dir, exist_ok=True)
    prev = None
    for i, st in enumerate(stages):
        run = os.path.abspath(os.path.join(args.runs_dir, st["name"]))
        left = remaining_s(st, run)
        if left > 0:
            if prev is not None and not os.path.isfile(os.path.join(prev, "ckpt", "latest_checkpointed_iteration.txt")):
                fail(f"stage {st['name']} starts from {prev}, which has no checkpoint")
            print(f"[{i + 1}/{len(stages)}] stage {st['name']}: {left:.0f} s of {st['budget_s']:.0f} s left"
                  f"{' (resuming)' if left < st['budget_s'] else ''}; LR {st['lr']:g}", flush=True)
            prefix = build_data(st, os.path.abspath(args.data_dir), args.python)
            train(st, prev, run, prefix, left)
        if "probe" in st and (left > 0 or not os.path.isfile(os.path.join(run, "probe.json"))):
            print(f"[{i + 1}/{len(stages)}] stage {st['name']}: {probe_line(probe(st, run, args.python))}", flush=True)
        prev = run
        if st["name"] == args.until:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
