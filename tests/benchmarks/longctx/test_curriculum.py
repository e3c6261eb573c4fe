"""examples/longctx/curriculum.py: the stage file, resumption bookkeeping and the stage
data (training itself runs end to end in test_longctx_recipe.py)."""

from __future__ import annotations

import collections
import copy
import importlib.util
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HERE = os.path.join(REPO, "examples", "longctx")


def _module():
    spec = importlib.util.spec_from_file_location("curriculum", os.path.join(HERE, "curriculum.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cur = _module()

STAGE = {"name": "s1", "lr": 1e-3, "budget_s": 600, "seq_length": 1024, "global_batch": 8,
         "mixes": [{"tasks": "recite", "lengths": "256,512", "docs": 30, "seed": 3},
                   {"tasks": "niah_single,niah_multikey", "lengths": "1024", "docs": 10, "seed": 4}]}


def test_shipped_stage_files_parse_and_chain_from_short_to_long():
    shipped = {name: cur.load_stages(os.path.join(HERE, name))
               for name in ("stages.json", "stages_smoke.json")}
    for stages in shipped.values():
        assert all(s["loss"] == "answer" for s in stages) and len(stages) >= 2
    lineage = shipped["stages.json"]
    # The measured lineage: copying (repeat) first, needle retrieval last, every stage probed.
    assert lineage[0]["mixes"][0]["tasks"] == "repeat"
    last_tasks = {t for m in lineage[-1]["mixes"] for t in m["tasks"].split(",")}
    assert "repeat" not in last_tasks and "niah_single" in last_tasks
    assert all("probe" in s for s in lineage)


def test_defaults_and_normalised_fields():
    (st,) = cur.parse_stages({"stages": [STAGE]})
    assert st["loss"] == "answer" and st["note"] == "" and "probe" not in st
    assert st["mixes"][1] == {"tasks": "niah_single,niah_multikey", "lengths": "1024", "docs": 10, "seed": 4}
    (st,) = cur.parse_stages({"stages": [dict(STAGE, loss="all", probe={
        "tasks": "recite", "lengths": [256], "samples": 5, "seed": 9})]})
    assert st["loss"] == "all" and st["probe"]["lengths"] == "256"


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(lr=0), "lr must be a number"),
    (lambda s: s.update(global_batch=1), "global_batch must be an integer >= 2"),
    (lambda s: s.update(global_batch=2.5), "global_batch must be an integer"),
    (lambda s: s.update(loss="prompt"), "loss must be 'answer' or 'all'"),
    (lambda s: s.update(name="a b"), "name must be"),
    (lambda s: s.update(mixes=[]), "mixes must be a non-empty list"),
    (lambda s: s["mixes"][0].update(lengths="256,x"), "comma list of integers"),
    (lambda s: s["mixes"][0].update(lengths="2048"), "2048 tokens do not fit seq_length 1024"),
    (lambda s: s["mixes"][0].update(docs=0), "docs must be an integer >= 1"),
    (lambda s: s["mixes"][0].update(filler=0.1), "unknown key.*filler"),
    (lambda s: s["mixes"][1].update(value_digits=0), "value_digits must be an integer >= 1"),
    (lambda s: s.update(probe={"tasks": "recite", "lengths": "512", "samples": 0, "seed": 1}), "samples must be"),
    (lambda s: s["mixes"][0].update(tasks="recite,niah_singel"), "mix 0: task must be one of .*niah_singel"),
    (lambda s: s.update(probe={"tasks": "niah_single", "lengths": "256", "samples": 5, "seed": 1}),
     "probe: length 256 is too small for task niah_single"),
])
def test_bad_stages_are_named_in_the_error(edit, message):
    st = copy.deepcopy(STAGE)
    edit(st)
    with pytest.raises(cur.StageError, match=message):
        cur.parse_stages({"stages": [st]})


def test_duplicate_names_and_empty_files_are_rejected():
    with pytest.raises(cur.StageError, match="used twice"):
        cur.parse_stages({"stages": [STAGE, STAGE]})
    for spec in ({}, {"stages": []}, [STAGE], {"stages": [STAGE], "extra": 1}):
        with pytest.raises(cur.StageError):
            cur.parse_stages(spec)


def _meta(run, wall_clock_s, iterations=100):
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "train_meta.json"), "w") as f:
        json.dump({"wall_clock_s": wall_clock_s, "iterations": iterations}, f)


def test_remaining_budget_resumes_a_stage_cut_short(tmp_path):
    (st,) = cur.parse_stages({"stages": [STAGE]})
    run = str(tmp_path / "s1")
    assert cur.remaining_s(st, run) == 600  # never trained
    _meta(run, 200.0)
    assert cur.remaining_s(st, run) == pytest.approx(400.0)
    _meta(run, 550.0)  # 50 s short: a launch would be mostly start-up
    assert cur.remaining_s(st, run) == 0.0
    _meta(run, 610.0)
    assert cur.remaining_s(st, run) == 0.0
    short = dict(st, budget_s=30.0)  # a 30 s stage is not "done" before it ran
    assert cur.remaining_s(short, str(tmp_path / "new")) == 30.0


def test_status_lists_every_stage_with_its_state_and_probe(tmp_path):
    stages = cur.parse_stages({"stages": [STAGE, dict(STAGE, name="s2"), dict(STAGE, name="s3")]})
    _meta(str(tmp_path / "s1"), 601.0, 700)
    _meta(str(tmp_path / "s2"), 100.0, 90)
    probe = {"accuracy": {"recite": {"512": {"accuracy": 0.25, "token_accuracy": 0.8, "digit_accuracy": 0.6}}}}
    (tmp_path / "s1" / "probe.json").write_text(json.dumps(probe))
    lines = cur.status(stages, str(tmp_path))
    assert "done" in lines[0] and "700 steps" in lines[0] and "recite@512: exact 0.25 token 0.80 digit 0.60" in lines[0]
    assert "partial" in lines[1] and "100 / 600 s" in lines[1]
    assert "to do" in lines[2]


KNOBS_STAGE = dict(STAGE, mixes=[{"tasks": "niah_single", "lengths": "512", "docs": 6, "seed": 7, "value_digits": 20},
                                  {"tasks": "niah_single", "lengths": "512", "docs": 6, "seed": 8}])


@pytest.fixture(scope="module")
def first_builds(tmp_path_factory):
    """The first ``build_data`` of each stage below, each in its own empty directory, run at
    once: a build is a chain of single-threaded generator and tokenizer processes, so on
    the 2-core machine two chains overlap. Name -> (stage, directory, future of the prefix)."""
    stages = {"mixes": STAGE, "knobs": KNOBS_STAGE}
    out = {}
    with ThreadPoolExecutor(len(stages)) as pool:
        for name, spec in stages.items():
            (st,) = cur.parse_stages({"stages": [spec]})
            d = tmp_path_factory.mktemp(name)
            out[name] = (st, d, pool.submit(cur.build_data, st, str(d), sys.executable))
    return out


def test_stage_data_holds_every_mix_shuffled_with_loss_starts(first_builds):
    st, tmp_path, built = first_builds["mixes"]
    prefix = built.result()
    assert prefix == str(tmp_path / "s1" / "train_text_document")
    assert sorted(os.listdir(tmp_path)) == ["s1"]  # built under a temporary name, then renamed
    docs = [json.loads(x) for x in (tmp_path / "s1" / "train.jsonl").open()]
    assert len(docs) == 40
    recite = ["What are the special magic numbers" in d["text"] for d in docs]
    assert sum(recite) == 30
    assert recite[:30] != [True] * 30  # the two mixes are interleaved
    starts = np.load(str(tmp_path / "s1" / "train_text_document_loss_start.npy"))
    assert len(starts) == 40 and (starts > 0).all()
    lengths = collections.Counter(len(d["text"]) > 700 for d in docs)
    assert lengths[True] >= 10  # the 1024-token needle documents are there
    # Built once: a second call does not rebuild (the file is left untouched).
    mtime = os.path.getmtime(prefix + ".idx")
    assert cur.build_data(st, str(tmp_path), sys.executable) == prefix
    assert os.path.getmtime(prefix + ".idx") == mtime


def test_task_knobs_of_a_mix_reach_its_documents(first_builds):
    st, tmp_path, built = first_builds["knobs"]
    assert st["mixes"][0]["value_digits"] == 20 and "value_digits" not in st["mixes"][1]
    built.result()
    docs = [json.loads(x) for x in (tmp_path / "s1" / "train.jsonl").open()]
    answers = collections.Counter(len(d["text"][d["loss_start"]:].strip()) for d in docs)
    assert answers == {20: 6, 7: 6}  # RULER's 7 digits unless the mix says otherwise
    assert all(d["text"][d["loss_start"]:].strip().isdigit() for d in docs)
