"""benchmarks/real_finetune.py on a tiny GGUF converted by ``gguf-to-megatron`` (no download): a
10-document corpus, 4 held out, 2 sparse fine-tuning steps. The documents (100..300 tokens)
run past the routing's dense reach (sink + diagonal + top-2 blocks of 16 = 64 tokens), so the
sparse and dense scores differ. Checks: the split is disjoint and the training reads only the
train documents; the report's keys and intervals; the "before" scores are the pretrained
model's (dense: transformers' loss of the GGUF; sparse and dense: a direct rescoring of the
checkpoint); the "after" scores are the fine-tuned checkpoint's, whose weights differ."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _gguf_models import converted_tiny_model, tiny_bpe  # noqa: E402

TOOL = os.path.join(ROOT, "benchmarks", "real_finetune.py")
N_DOCS, HELDOUT, SEQ = 10, 4, 256


@pytest.fixture(scope="module")
def run(tmp_path_factory, world):
    """(tmp dir, corpus documents, the tool's report, the direct rescoring of both checkpoints)."""
    from megatron.training.indexed_io import write_documents

    d = tmp_path_factory.mktemp("real_ft")
    converted_tiny_model(world, str(d))
    rng = np.random.default_rng(0)
    vocab = len(tiny_bpe()[0])
    docs = [rng.integers(0, vocab, size=int(n)).astype(np.int64) for n in rng.integers(100, 300, size=N_DOCS)]
    write_documents(str(d / "docs"), docs, vocab)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, TOOL, "--load", str(d / "ckpt"), "--data-path", str(d / "docs"),
                        "--heldout-docs", str(HELDOUT), "--train-iters", "2", "--seq-length", str(SEQ),
                        "--block-size", "16", "--topk", "2", "--workdir", str(d / "work"), "--threads", "1",
                        "--json", "--out", str(d / "report.json")],
                       capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout)
    assert json.loads((d / "report.json").read_text()) == report
    p = subprocess.run([sys.executable, os.path.join(HERE, "_finetune_worker.py"), str(d / "report.json"),
                        str(d / "direct.json")], capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="1"),
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return d, docs, report, json.loads((d / "direct.json").read_text())


def test_split_is_disjoint_and_training_reads_only_train_documents(run):
    from benchmarks.real_finetune import split_documents
    from megatron.training.indexed_io import open_dataset

    d, docs, r, _ = run
    train_ids, held = split_documents(N_DOCS, HELDOUT, 0)
    assert r["split"]["heldout_ids"] == r["heldout"]["ids"] == held.tolist()
    assert (r["split"]["train_docs"], r["split"]["heldout_docs"]) == (N_DOCS - HELDOUT, HELDOUT)
    assert not set(train_ids.tolist()) & set(held.tolist()) and len(train_ids) + len(held) == N_DOCS
    train = open_dataset(str(d / "work" / "train"))
    got = [np.asarray(train[i]).astype(np.int64).tolist() for i in range(len(train))]
    assert got == [docs[i].tolist() for i in train_ids]  # exactly the train documents, in order
    assert not any(docs[i].tolist() in got for i in held)
    assert r["settings"]["data_path"] == str(d / "docs")
    assert f"--data-path {d / 'work' / 'train'} " in r["train_command"]


def test_report_keys_and_intervals(run):
    _, _, r, _ = run
    for name in ("sparse", "dense"):
        lo, med, hi = r[f"finetuned_minus_pretrained_{name}"]
        assert lo <= med <= hi and all(math.isfinite(x) for x in (lo, med, hi))
        mean = r[f"heldout_{name}_loss_after"] - r[f"heldout_{name}_loss_before"]
        assert r[f"finetuned_minus_pretrained_{name}_detail"]["mean"] == pytest.approx(mean, abs=1e-9)
        assert r[f"finetuned_minus_pretrained_{name}_detail"]["n"] == HELDOUT
    assert len(r["train_losses"]) == 2 and r["train_loss_first"] == r["train_losses"][0]
    assert r["train_loss_last"] == r["train_losses"][1]
    assert set(r["seconds"]) == {"score_before", "train", "score_after", "total"}
    assert r["command"].startswith("benchmarks/real_finetune.py --load")
    assert "--finetune --sparse-balance" in r["train_command"] and "--global-batch-size 1 " in r["train_command"]
    s = r["settings"]
    assert (s["lr"], s["min_lr"], s["lr_decay_style"], s["train_iters"], s["seq_length"]) == (2e-5, 2e-6, "cosine", 2,
                                                                                              SEQ)
    assert r["heldout"]["scored_tokens"] == [min(n, SEQ) - min(n, SEQ) // 2 for n in r["heldout"]["lengths"]]


def test_before_is_the_pretrained_model(run):
    """Dense: transformers' loss of the GGUF on each held-out document's second half; both
    attentions: a direct rescoring of the pretrained checkpoint. Sparse differs from dense."""
    from transformers import AutoModelForCausalLM

    d, docs, r, direct = run
    h = r["heldout"]
    assert direct["pretrained"]["iteration"] == 0
    np.testing.assert_allclose(h["sparse_before"], direct["pretrained"]["sparse"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(h["dense_before"], direct["pretrained"]["dense"], rtol=0, atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="model.gguf", dtype=torch.float32).eval()
    ref = []
    with torch.no_grad():
        for i in h["ids"]:
            doc = torch.as_tensor(docs[i][:SEQ])
            n = len(doc)
            logits = model(doc[None]).logits[0].double()
            ref.append(float(torch.nn.functional.cross_entropy(logits[n // 2 - 1:n - 1], doc[n // 2:])))
    np.testing.assert_allclose(h["dense_before"], ref, rtol=0, atol=1e-3)
    assert max(abs(a - b) for a, b in zip(h["sparse_before"], h["dense_before"])) > 1e-3  # sparse is not dense here
    weights = h["scored_tokens"]
    assert r["heldout_sparse_loss_before"] == pytest.approx(np.average(h["sparse_before"], weights=weights))


def test_after_is_the_finetuned_checkpoint(run):
    _, _, r, direct = run
    h = r["heldout"]
    assert direct["finetuned"]["iteration"] == r["finetuned_iteration"] == 2
    assert direct["keys_match"] and direct["max_weight_diff"] > 0  # trained weights, not the pretrained ones
    np.testing.assert_allclose(h["sparse_after"], direct["finetuned"]["sparse"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(h["dense_after"], direct["finetuned"]["dense"], rtol=0, atol=1e-6)
    assert h["sparse_after"] != h["sparse_before"]


def test_pipeline_training_goes_through_torchrun():
    import types

    from benchmarks.real_finetune import train_command

    a = types.SimpleNamespace(pp=2, load="M", block_size=64, topk=8, train_iters=20, seed=0)
    cmd = train_command(a, ["--num-layers", "2"], "W/train", "W/ckpt", "W/s.json")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert cmd[cmd.index("--pipeline-model-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--lr-warmup-iters") + 1] == "2" and cmd[cmd.index("--save") + 1] == "W/ckpt"
