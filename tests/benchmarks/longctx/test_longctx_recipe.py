"""examples/longctx end to end on tiny settings: data with loss starts, the base model's
two-stage curriculum (each stage on its own mix, the second from the first's weights,
both probed), an arm started from the last stage's weights with answer-only loss,
evaluation and the results file (run_all.sh, the path the comparison takes; process
start-up dominates its run time).

Budgets are 5 s, shorter than a launch's start-up: train_arm.sh's watchdog repeats USR1
every 5 s, so each run stops at its first step boundary once its workers catch the
signal (at least one step, then a checkpoint). How much a run trains does not matter
here, only that each run trained from the right weights with the right settings; the
learning rate each stage applied is read from its checkpoint's optimizer state, which
does not depend on how many steps (and so log lines) the budget allowed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _trained_lr(run) -> float:
    """The learning rate a run's optimizer applied (constant after one warm-up step), from
    its final checkpoint: every parameter group's rate and the schedule's peak agree."""
    from megatron.training.checkpointing import iter_dir, read_tracker

    it = read_tracker(str(run / "ckpt"))
    state = torch.load(os.path.join(iter_dir(str(run / "ckpt"), it), "common.pt"), map_location="cpu",
                       weights_only=False)
    assert state["iteration"] == it >= 1 and state["scheduler"]["lr_decay_style"] == "constant"
    lrs = {g["lr"] for g in state["optimizer"]["param_groups"]} | {state["scheduler"]["max_lr"]}
    assert len(lrs) == 1, lrs
    return lrs.pop()


def test_recipe_with_curriculum_end_to_end(tmp_path):
    runs, data, result = tmp_path / "runs", tmp_path / "data", tmp_path / "acc.json"
    stages = {"stages": [
        {"name": "copy", "lr": 3e-3, "budget_s": 5, "seq_length": 1024, "global_batch": 2,
         "mixes": [{"tasks": "repeat", "lengths": "256,512", "docs": 40, "seed": 5, "copy_chars": 32}],
         "probe": {"tasks": "repeat", "lengths": "512", "samples": 1, "seed": 78}},
        {"name": "needles", "lr": 1e-3, "budget_s": 5, "seq_length": 1024, "global_batch": 2, "loss": "all",
         "mixes": [{"tasks": "recite", "lengths": "256", "docs": 20, "seed": 17},
                   {"tasks": "niah_single", "lengths": "512", "docs": 20, "seed": 16}],
         "probe": {"tasks": "recite", "lengths": "512", "samples": 1, "seed": 86}}]}
    (tmp_path / "stages.json").write_text(json.dumps(stages))
    env = dict(os.environ, SB_ROOT=REPO, DATA_DIR=str(data), RUNS_DIR=str(runs), RESULT_FILE=str(result),
               NUM_TRAIN_DOCS="40", TRAIN_LENGTHS="1024", SEQ_LENGTH="1024", MAX_POSITIONS="1024",
               FILLER_SHARE="0.25", EVAL_LENGTHS="1024", EVAL_SAMPLES="1", NEEDLE_LENGTH="1024",
               MEAN_LENGTHS="1024", NUM_LAYERS="2", HIDDEN="32", HEADS="2", GLOBAL_BATCH="2",
               WARMUP="1", SAVE_INTERVAL="1000", BUDGET_S="5", SEEDS="1", ARMS="dense",
               CURRICULUM=str(tmp_path / "stages.json"), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BASE_DIR"):
        env.pop(k, None)
    p = subprocess.run(["bash", os.path.join(REPO, "examples", "longctx", "run_all.sh")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

    # Data: every mix carries loss starts; the first stage holds only repeat documents, the
    # second its two mixes, the arms' mix all five tasks and filler.
    stage_data = {n: data / "curriculum" / n for n in ("copy", "needles")}
    for d in (data, *stage_data.values()):
        starts = np.load(d / "train_text_document_loss_start.npy")
        assert len(starts) == 40 and (starts > 0).any()
    for x in (stage_data["copy"] / "train.jsonl").open():  # filler, a 16-32 char code, request, the code
        text = json.loads(x)["text"]
        assert re.fullmatch(r"[^\n]*\n([0-9A-Z]{16,32})\nRepeat the code above\. Answer: \1\n", text), text[-200:]
    texts = [json.loads(x)["text"] for x in (stage_data["needles"] / "train.jsonl").open()]
    assert sum("What are the special magic numbers" in t for t in texts) == 20
    heads = {json.loads(x)["text"][:12] for x in (data / "train.jsonl").open()}
    assert len(heads) > 3 and "A secret cod" not in heads

    # Each stage started from the previous one's weights; the arm from the last stage's,
    # training answers only; the second stage trained on every token (its "loss").
    cur = runs / "curriculum"
    copy_meta = json.loads((cur / "copy" / "train_meta.json").read_text())
    needles_meta = json.loads((cur / "needles" / "train_meta.json").read_text())
    arm_meta = json.loads((runs / "dense" / "seed1" / "train_meta.json").read_text())
    assert copy_meta["init_from"] is None and copy_meta["iterations"] >= 1 and copy_meta["arm"] == "stage"
    assert needles_meta["init_from"] == str(cur / "copy" / "ckpt") and needles_meta["iterations"] >= 1
    assert arm_meta["init_from"] == str(cur / "needles" / "ckpt") and arm_meta["iterations"] >= 1
    logs = {n: (cur / n / "train.log").read_text() for n in ("copy", "needles")}
    logs["arm"] = (runs / "dense" / "seed1" / "train.log").read_text()
    summary = {n: json.loads([ln for ln in log.splitlines() if ln.startswith("SUMMARY_JSON ")][-1].split(" ", 1)[1])
               for n, log in logs.items()}
    assert summary["copy"]["args"]["mask_prompt_loss"] is True and _trained_lr(cur / "copy") == 3e-3
    assert summary["needles"]["args"]["mask_prompt_loss"] is False and _trained_lr(cur / "needles") == 1e-3
    assert summary["arm"]["args"]["mask_prompt_loss"] is True and summary["arm"]["args"]["finetune"] is True
    assert summary["arm"]["args"]["load"] == str(cur / "needles" / "ckpt")
    assert (runs / "dense" / "seed1" / "ckpt" / "latest_checkpointed_iteration.txt").exists(), logs["arm"][-500:]
    # Both stages were probed on their own samples (greedy: exact, token and digit accuracy).
    for name, task in (("copy", "repeat"), ("needles", "recite")):
        probe = json.loads((cur / name / "probe.json").read_text())
        cell = probe["accuracy"][task]["512"]
        assert cell["n"] == 1 and 0.0 <= cell["digit_accuracy"] <= 1.0, cell
        assert all(0.0 <= a <= 1.0 for a in cell["position_accuracy"]) and len(cell["position_accuracy"]) > 1
    assert "copy" in p.stdout and "needles" in p.stdout and "recite@512: exact" in p.stdout
    # Where inside the answers the last stage goes wrong: one row per cell, one number per
    # answer token (a needle's 7 digits and the terminator).
    ev = subprocess.run([sys.executable, "benchmarks/eval_longctx.py", "--load",
                         str(cur / "needles" / "ckpt"),
                         "--train-args", (cur / "needles" / "model_flags.txt").read_text(),
                         "--tasks", "niah_single", "--lengths", "512",
                         "--num-samples", "2", "--seed", "86", "--per-position", "--quiet"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    rows = ev.stdout.split("(the terminator last):\n", 1)[1].splitlines()
    assert len(rows) == 1 and rows[0].split()[:2] == ["niah_single", "512"], ev.stdout
    assert len(rows[0].split()) == 2 + 8 and all(float(a) in (0.0, 0.5, 1.0) for a in rows[0].split()[2:])

    out = json.loads(result.read_text())
    dense = out["arms"]["dense"]
    assert dense["seeds"] == [1] and 0.0 <= dense["needle_4k"] <= 1.0 and 0.0 <= dense["mean"] <= 1.0
    assert out["base"]["iterations"] == needles_meta["iterations"]
    assert set(dense["per_task"]) == {"niah_single", "niah_multikey", "niah_multivalue",
                                      "variable_tracking", "freq_words"}
