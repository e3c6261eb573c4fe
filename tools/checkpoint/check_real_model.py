"""Check a GGUF model converted by ``convert.py gguf-to-megatron`` against transformers' GGUF loader.

    make real-model   # runs/models/smollm2-135m and the GGUF it came from
    OMP_NUM_THREADS=2 .venv/bin/python tools/checkpoint/check_real_model.py \\
        --load runs/models/smollm2-135m --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf

Two documents (the first ``--tokens`` tokens of each ``--text`` file, by the converted
tokenizer ``LOAD/hf``; by default Python's ``argparse.py`` and ``LICENSE.txt``) go through
(1) the driver's packed forward (THD, dense attention, fp32, CPU) and transformers' forward
of each document; (2) one ``pretrain_gpt.py $(cat LOAD/model_flags.txt) --load LOAD
--finetune`` step (``--lr 0``, ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model
LOAD/hf``) on the same documents, whose first logged loss is compared with transformers'
mean next-token loss over the documents' own targets. Prints one JSON line:
``max_logit_diff`` (max |driver - transformers| over every token and vocabulary entry),
``max_abs_logit``, ``loss_driver``, ``loss_transformers``, ``loss_diff``, ``tokens``.
About 2 minutes and 3 GB on 2 CPU threads for SmolLM2-135M.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.training.arguments import OneLineParser, UsageError, usage_error  # noqa: E402

PROG = "check_real_model.py"

STDLIB = os.path.dirname(os.__file__)
DEFAULT_TEXTS = (os.path.join(STDLIB, "argparse.py"), os.path.join(STDLIB, "LICENSE.txt"))
"""Python's own code and licence prose: on every machine, fixed for a Python version."""


def driver_logits(ckpt: str, tokens, cu_seqlens):
    """Our GPTModel's logits ``[T, vocab]`` (float64 numpy) for documents packed in ``tokens``
    (``[T]`` ids, boundaries ``cu_seqlens``), built from ``ckpt/model_flags.txt`` (TP=PP=1, fp32,
    CPU) and loaded as ``pretrain_gpt.py --finetune`` loads it; one THD forward, dense attention."""
    import torch
    from convert import _build, _model_args
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.training.checkpointing import load_weights
    from megatron.training.initialize import shutdown

    tokens = torch.as_tensor(tokens).long()[None]
    cu = torch.as_tensor(cu_seqlens).int()
    pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])[None]
    max_len = int((cu[1:] - cu[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        model = _build(_model_args(f.read().split()))
    try:
        load_weights(ckpt, [types.SimpleNamespace(module=model)])
        model.eval()
        with torch.no_grad():
            logits = model(tokens, pos, None, packed_seq_params=packed)
        return logits.reshape(tokens.shape[1], -1).double().numpy()
    finally:
        shutdown()


def hf_logits_and_loss(model, docs):
    """transformers' logits of each document, concatenated (float64 numpy), and its mean
    next-token loss over the documents' own targets."""
    import torch

    total, count, out = 0.0, 0, []
    with torch.no_grad():
        for d in docs:
            logits = model(torch.as_tensor(d)[None]).logits[0].double()
            total += torch.nn.functional.cross_entropy(logits[:-1], torch.as_tensor(d[1:]), reduction="sum").item()
            count += len(d) - 1
            out.append(logits.numpy())
    import numpy as np

    return np.concatenate(out), total / count


def finetune_loss(ckpt: str, docs, vocab: int, work: str) -> float:
    """The first logged loss of a one-step ``pretrain_gpt.py --load CKPT --finetune`` run
    (``--lr 0``) on ``docs``, all in one micro-batch."""
    from megatron.training.indexed_io import write_documents

    prefix = os.path.join(work, "docs")
    write_documents(prefix, docs, vocab)
    with open(os.path.join(ckpt, "model_flags.txt")) as f:
        flags = f.read().split()
    seq = 1 << (2 * sum(len(d) for d in docs) - 1).bit_length()  # room for every document, as in the tests
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--load", ckpt, "--finetune",
            "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            os.path.join(ckpt, "hf"), "--split", "1,0,0", "--seq-length", str(seq), "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "0", "--no-progress-bar"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("SUMMARY_JSON ")]
    if p.returncode != 0 or len(lines) != 1:
        raise RuntimeError(f"pretrain_gpt.py exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return json.loads(lines[0].split(" ", 1)[1])["losses"][0]


def check(load: str, gguf: str, texts, n_tokens: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from megatron.training.tokenizer import HFJsonTokenizer

    tok = HFJsonTokenizer(os.path.join(load, "hf"))
    docs = []
    for path in texts:
        with open(path) as f:
            ids = tok.encode(f.read())[:n_tokens]
        if len(ids) < n_tokens:
            raise UsageError(f"--text {path} has {len(ids)} tokens, fewer than --tokens {n_tokens}")
        docs.append(np.array(ids, dtype=np.int64))
    tokens = np.concatenate(docs)
    cu = np.cumsum([0] + [len(d) for d in docs])
    ours = driver_logits(load, tokens, cu)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(gguf)),
                                                 gguf_file=os.path.basename(gguf), dtype=torch.float32)
    model.eval()
    ref, loss_ref = hf_logits_and_loss(model, docs)
    del model
    with tempfile.TemporaryDirectory() as work:
        loss = finetune_loss(load, docs, tok.vocab_size, work)
    return {"max_logit_diff": float(np.abs(ours - ref).max()), "max_abs_logit": float(np.abs(ref).max()),
            "loss_driver": loss, "loss_transformers": loss_ref, "loss_diff": abs(loss - loss_ref),
            "tokens": [len(d) for d in docs]}


def main(argv=None) -> None:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint written by convert.py gguf-to-megatron")
    p.add_argument("--gguf", required=True, help="the GGUF file it was converted from")
    p.add_argument("--text", nargs="+", default=list(DEFAULT_TEXTS), help="one document per file")
    p.add_argument("--tokens", type=int, default=256, help="tokens taken from the start of each file")
    a = p.parse_args(argv)
    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    try:
        for path, what in [(os.path.join(a.load, "model_flags.txt"), "--load: no converted checkpoint"),
                           (a.gguf, "--gguf: no such file"), *((t, "--text: no such file") for t in a.text)]:
            if not os.path.isfile(path):
                raise UsageError(f"{what} ({path})")
        print(json.dumps(check(a.load, a.gguf, a.text, a.tokens)))
    except UsageError as e:
        usage_error(str(e), prog=PROG)


if __name__ == "__main__":
    main()
