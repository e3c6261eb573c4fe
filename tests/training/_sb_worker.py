"""Run ``pretrain()`` as pretrain_gpt.py does and dump, per rank, what the SparseBalance
tests compare: every step's DST budget table (under threshold routing its TAU table), the
budget each attention call used (the attention records) and the sampler state after the step.

Writes ``$SB_TEST_DUMP/rank<r>.json`` (a test-only env var, not a driver flag).
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main() -> None:
    import torch
    from megatron.core import parallel_state as ps

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import shutdown
    from megatron.training.training import pretrain

    dump = os.environ["SB_TEST_DUMP"]
    args = parse_args()
    steps = []

    def on_step(iteration, state, result):
        steps.append({
            "iteration": iteration,
            "budget": None if result.budget is None else [[list(map(int, s)) for s in m]
                                                          for m in result.budget],
            "records": [[r.layer_number, r.microbatch, r.topk] for r in result.attention_records],
            # threshold routing: DST's TAU table and the TAU and kept pairs of every attention call
            "tau": None if result.tau is None else [[list(map(float, s)) for s in m] for m in result.tau],
            "record_taus": [[r.layer_number, r.microbatch, r.tau, r.kept_pairs, r.causal_pairs]
                            for r in result.attention_records],
            "sampler": state.loader.state_dict(),
        })

    summary = pretrain(args, on_step=on_step)
    out = {"rank": torch.distributed.get_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
           "dp_rank": ps.get_data_parallel_rank(), "steps": steps, "summary": summary}
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)
    shutdown()


if __name__ == "__main__":
    main()
