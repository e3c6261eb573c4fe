"""Run ``pretrain()`` exactly as pretrain_gpt.py does and dump what tests compare.

Launched by the tests (python or torchrun) with pretrain_gpt.py's flags; the dump
directory comes from ``SB_TEST_DUMP`` (not a flag: the driver has no test flags).
Each rank writes ``rank<r>.npz`` with per-step global loss and grad norm and the
last step's gradients (main_grad) keyed by PP-independent parameter names (under TP > 1
gathered over the TP group, so every layout dumps whole tensors); its
``rank<r>.json`` is the run summary plus ``budgets`` (each step's DST table or None) and
``microbatch_tokens`` (per step, ``(micro-batch, real tokens)`` as its sparse attention saw them).

``SB_TEST_PREDICT_AS_CP1=1`` builds SAB's and DST's predictor as for
``--context-parallel-size 1`` (the CP-aware one plans other budgets), so a CP run
packs and budgets exactly as its CP=1 reference (tests/training/test_cp_training.py).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> None:
    import numpy as np
    import torch

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import shutdown
    from megatron.training.model import global_param_names
    from megatron.training.training import pretrain

    dump = os.environ["SB_TEST_DUMP"]
    if os.environ.get("SB_TEST_PREDICT_AS_CP1") == "1":
        _predict_as_cp1()
    args = parse_args()
    if args.mock_data:  # pretrain_gpt.py writes the mock dataset in its input checks
        from megatron.training.data_sources import write_mock_data
        from megatron.training.tokenizer import args_vocab_size

        write_mock_data(args, args_vocab_size(args))
    grads, budgets, mb_tokens = {}, [], []

    def on_step(iteration, state, result):
        budgets.append(None if result.budget is None else np.asarray(result.budget).tolist())
        # real tokens of each micro-batch this rank's sparse attention saw (none if dense)
        mb_tokens.append(sorted({(r.microbatch, sum(r.doc_lengths)) for r in result.attention_records}))
        grads.clear()
        for chunk in state.model:
            for name, p in global_param_names(chunk).items():
                grads[name] = _whole(p, p.main_grad.detach()).double().numpy().copy()

    summary = pretrain(args, on_step=on_step)
    rank = torch.distributed.get_rank()
    os.makedirs(dump, exist_ok=True)
    np.savez(os.path.join(dump, f"rank{rank}.npz"), **{"grad/" + k: v for k, v in grads.items()})
    with open(os.path.join(dump, f"rank{rank}.json"), "w") as f:
        json.dump(dict(summary, budgets=budgets, microbatch_tokens=mb_tokens), f)
    shutdown()


def _whole(param, tensor):
    """``tensor`` (a TP shard of ``param``'s shape) gathered over the TP group along the
    parameter's partition dimension; unsharded parameters as they are."""
    import torch
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim)


def _predict_as_cp1() -> None:
    import dataclasses

    from sparsebalance import balancer

    build = balancer.build_predictor

    def as_cp1(config, *a, **k):
        config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, cp=1))
        return build(config, *a, **k)

    balancer.build_predictor = as_cp1


if __name__ == "__main__":
    main()
