"""Run by test_eval_model.py in a subprocess (it initialises torch.distributed):
builds a tiny GPT exactly as benchmarks/eval_longctx.py does (random weights, PP=1,
CPU) and prints JSON facts about ``EvalModel.logits``."""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402


def main() -> None:
    import eval_longctx as E
    import torch

    from megatron.training.arguments import build_parser

    torch.set_num_threads(1)
    args = build_parser().parse_args([*PROJECT_RUN_FLAGS, "--num-layers", "2", "--hidden-size", "32",
                                      "--num-attention-heads", "4",
                                      "--seq-length", "512", "--cpu"])
    args.virtual_pipeline_model_parallel_size = None
    args.max_position_embeddings, args.ffn_hidden_size = 512, 128
    model = E.build_eval_model(args, lambda chunks: None, sparse=False, sb_topk=None, sb_block_size=None,
                               backend=None)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randint(0, 256, (150,), generator=g), torch.randint(0, 256, (90,), generator=g)
        la, lb = model.logits([a, b])
        iso = max(float((la - model.logits([a])[0]).abs().max()), float((lb - model.logits([b])[0]).abs().max()))
        # Causality: teacher-forced logits equal those of a forward on the prefix alone.
        full = model.logits([a])[0]
        causal = max(float((model.logits([a[:n]])[0][-1] - full[n - 1]).abs().max()) for n in (1, 40, 149))
        print(json.dumps({"shapes": [list(la.shape), list(lb.shape)], "isolation": iso, "causal": causal,
                          "scale": float(full.abs().max())}))
    finally:
        model.close()


if __name__ == "__main__":
    main()
