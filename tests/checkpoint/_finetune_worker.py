"""Direct scoring of the checkpoints a ``benchmarks/real_finetune.py`` report names.

    python _finetune_worker.py REPORT.json OUT.json

Rebuilds each model (the pretrained ``--load`` and the fine-tuned ``finetuned_checkpoint``) with
``tools/eval_longctx.load_eval_model`` and scores the report's held-out documents one by one with
``benchmarks/real_accuracy.py``'s forward and loss, under static top-k and dense attention. Writes
``{"pretrained": {...}, "finetuned": {...}, "max_weight_diff": float}``, each model's entry with
``sparse`` / ``dense`` per-document losses and its ``iteration``.
"""

import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tools")]


def score(root, flags, s, docs):
    import torch
    from eval_longctx import load_eval_model
    from real_accuracy import attention_modules, forward, scored_loss, set_arm

    from benchmarks.harness.compare.real_arms import Arm

    model = load_eval_model(root, flags, sparse=True, sb_topk=s["topk"], sb_block_size=s["block_size"], backend=None)
    out = {"iteration": model.iteration, "sparse": [], "dense": []}
    try:
        cores = attention_modules(model)
        with torch.no_grad():
            for doc in docs:
                tokens = torch.as_tensor(doc, dtype=torch.long)
                cu = torch.tensor([0, len(doc)], dtype=torch.int32)
                for name, arm in (("sparse", Arm("s", topk=s["topk"])), ("dense", Arm("dense"))):
                    set_arm(cores, arm, 0)
                    total, count = scored_loss(forward(model, tokens, cu), tokens, cu, "second-half")
                    out[name].append(total / count)
        weights = {k: v.detach().clone() for k, v in model.gpt.state_dict().items() if torch.is_tensor(v)}
    finally:
        model.close()
    return out, weights


def main():
    import numpy as np
    from real_accuracy import model_flags

    from megatron.training import quiet_optional_extras
    from megatron.training.indexed_io import open_dataset

    quiet_optional_extras()
    with open(sys.argv[1]) as f:
        report = json.load(f)
    s = report["settings"]
    ds = open_dataset(s["data_path"])
    docs = [np.asarray(ds[i])[:s["seq_length"]].astype(np.int64) for i in report["heldout"]["ids"]]
    flags = " ".join(shlex.quote(x) for x in model_flags(s["load"]) + ["--seq-length", str(s["seq_length"])])
    pre, w0 = score(s["load"], flags, s, docs)
    post, w1 = score(report["finetuned_checkpoint"], flags, s, docs)
    diff = max(float((w1[k].float() - w0[k].float()).abs().max()) for k in w0 if w0[k].is_floating_point())
    with open(sys.argv[2], "w") as f:
        json.dump({"pretrained": pre, "finetuned": post, "max_weight_diff": diff,
                   "keys_match": sorted(w0) == sorted(w1)}, f)


if __name__ == "__main__":
    main()
