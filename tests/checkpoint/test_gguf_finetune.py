"""Sparse fine-tuning from pretrained weights (issue 50 item 3): ``pretrain_gpt.py $(cat
DIR/model_flags.txt) --load DIR --finetune --sparse-balance ... --tokenizer-type
HuggingFaceTokenizer --tokenizer-model DIR/hf`` on a tiny GGUF converted by
``gguf-to-megatron``: its first loss is the pretrained model's, i.e. transformers' loss of
the GGUF on the same batch (1e-3), under PP=1 and PP=2. The documents fit within the dense
reach of the routing (sink + diagonal + top-k blocks), so sparse attention equals dense and
the comparison is exact; what it checks is that the weights, tokenizer and packing of a
SparseBalance run start where the pretrained model is (not at ln(vocab))."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _gguf_models import converted_tiny_model, tiny_bpe  # noqa: E402

PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
LENGTHS = (41, 59)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, world):
    """(checkpoint dir, data prefix, documents, transformers' mean next-token loss on them)."""
    from transformers import AutoModelForCausalLM

    from megatron.training.indexed_io import write_documents

    d = tmp_path_factory.mktemp("ft")
    converted_tiny_model(world, str(d))
    rng = np.random.RandomState(0)
    vocab = len(tiny_bpe()[0])
    docs = [rng.randint(0, vocab, size=n).astype(np.int64) for n in LENGTHS]
    write_documents(str(d / "docs"), docs, vocab)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="model.gguf", dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for doc in docs:
            logits = model(torch.as_tensor(doc)[None]).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits[:-1], torch.as_tensor(doc[1:]), reduction="sum"))
    return d / "ckpt", str(d / "docs"), docs, total / sum(n - 1 for n in LENGTHS), vocab


@pytest.mark.parametrize("pp", [1, 2])
def test_sparse_finetune_starts_at_the_pretrained_loss(tiny, world, pp, tmp_path):
    ckpt, prefix, docs, loss_ref, vocab = tiny
    flags = (ckpt / "model_flags.txt").read_text().split()
    summary = tmp_path / "summary.json"
    args = [*flags, "--load", str(ckpt), "--finetune", "--sparse-balance", "--sb-cost-model", "h100-analytic",
            "--sb-block-size", "16", "--sb-topk", "4", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(ckpt / "hf"), "--data-path", prefix, "--split", "1,0,0", "--seq-length", "128",
            "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--lr-warmup-iters", "0",
            "--pipeline-model-parallel-size", str(pp), "--cpu", "--distributed-backend", "gloo",
            "--log-interval", "1", "--eval-interval", "0", "--no-progress-bar", "--summary-json", str(summary)]
    assert max(LENGTHS) <= (4 + 2) * 16  # within the routing's dense reach: sparse == dense here
    p = world.launch(PRETRAIN, args, nproc=pp)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["tokens"] >= sum(LENGTHS)  # the first step holds both documents (one micro-batch)
    first = s["losses"][0]
    assert abs(first - loss_ref) < 1e-3, (first, loss_ref)
    assert abs(first - math.log(vocab)) > 0.1  # a pretrained start, not a uniform one
    assert s["losses"][1] != first  # and it trains
