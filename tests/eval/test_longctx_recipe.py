"""examples/longctx end to end on tiny settings: data with loss starts, the copy warm-up,
the shared base stage started from it, an arm started from the base's weights with
answer-only loss, evaluation and the results file (run_all.sh, the path the comparison
takes; ~3 min on 2 cores)."""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_recipe_with_base_stage_end_to_end(tmp_path):
    runs, data, result = tmp_path / "runs", tmp_path / "data", tmp_path / "acc.json"
    env = dict(os.environ, SB_ROOT=REPO, DATA_DIR=str(data), RUNS_DIR=str(runs), RESULT_FILE=str(result),
               NUM_TRAIN_DOCS="40", TRAIN_LENGTHS="1024", SEQ_LENGTH="1024", MAX_POSITIONS="1024",
               FILLER_SHARE="0.25", EVAL_LENGTHS="1024", EVAL_SAMPLES="1", NEEDLE_LENGTH="1024",
               MEAN_LENGTHS="1024", NUM_LAYERS="2", HIDDEN="32", HEADS="2", GLOBAL_BATCH="2",
               WARMUP="1", SAVE_INTERVAL="1000", BUDGET_S="30", SEEDS="1", ARMS="dense",
               BASE_BUDGET_S="30", BASE_TRAIN_DOCS="40", BASE_GLOBAL_BATCH="2", OMP_NUM_THREADS="1",
               WARMUP_BUDGET_S="30", WARMUP_TRAIN_DOCS="40")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", os.path.join(REPO, "examples", "longctx", "run_all.sh")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

    # Data: every mix carries loss starts; the warm-up holds only repeat documents, the base
    # mix only the retrieval tasks (needles and copy), the arms' mix all five tasks and filler.
    for sub in ("", "base", "warmup"):
        starts = np.load(data / sub / "train_text_document_loss_start.npy")
        assert len(starts) == 40 and (starts > 0).any()
    heads = lambda sub: {json.loads(x)["text"][:12] for x in (data / sub / "train.jsonl").open()}
    assert heads("base") == {"Some special", "A secret cod"}, heads("base")
    assert len(heads("")) > 3 and "A secret cod" not in heads("")
    for x in (data / "warmup" / "train.jsonl").open():  # filler, a 16-32 char code, request, the code
        text = json.loads(x)["text"]
        assert re.fullmatch(r"[^\n]*\n([0-9A-Z]{16,32})\nRepeat the code above\. Answer: \1\n", text), text[-200:]

    # Each stage started from the previous one's weights; the arm trained answers only.
    warm_meta = json.loads((runs / "warmup" / "train_meta.json").read_text())
    base_meta = json.loads((runs / "base" / "train_meta.json").read_text())
    arm_meta = json.loads((runs / "dense" / "seed1" / "train_meta.json").read_text())
    assert warm_meta["init_from"] is None and warm_meta["iterations"] >= 1
    assert base_meta["init_from"] == str(runs / "warmup" / "ckpt") and base_meta["iterations"] >= 1
    assert arm_meta["init_from"] == str(runs / "base" / "ckpt") and arm_meta["iterations"] >= 1
    log = (runs / "dense" / "seed1" / "train.log").read_text()
    summary = json.loads([l for l in log.splitlines() if l.startswith("SUMMARY_JSON ")][-1].split(" ", 1)[1])
    assert summary["args"]["mask_prompt_loss"] is True and summary["args"]["finetune"] is True
    assert summary["args"]["load"] == str(runs / "base" / "ckpt")
    assert (runs / "dense" / "seed1" / "ckpt" / "latest_checkpointed_iteration.txt").exists(), log[-500:]

    out = json.loads(result.read_text())
    dense = out["arms"]["dense"]
    assert dense["seeds"] == [1] and 0.0 <= dense["needle_4k"] <= 1.0 and 0.0 <= dense["mean"] <= 1.0
    assert set(dense["per_task"]) == {"niah_single", "niah_multikey", "niah_multivalue",
                                      "variable_tracking", "freq_words"}
