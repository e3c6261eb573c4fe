"""Logits of a packed micro-batch before/after changing one document's tokens.

``_leakage.py PREFIX OUT_DIR VARIANT...``: for each VARIANT (more driver flags in one
string, split on spaces, e.g. position embedding variants; "" for none) builds the
driver's model (world of one, seeded afresh) and a real packed micro-batch from the
dataset PREFIX, and writes ``OUT_DIR/variant<i>.npz``: logits before/after,
cu_seqlens, which segment was changed, and how many head dims RoPE rotates. The
variants share one process (and its start-up); each gets its own model.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402


def main() -> None:
    import numpy as np

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training import initialize as init
    from megatron.training.arguments import parse_args

    prefix, out_dir, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
    for i, variant in enumerate(variants):
        args = parse_args([*PROJECT_RUN_FLAGS, "--data-path", prefix, "--num-layers", "2", "--hidden-size", "64",
                           "--num-attention-heads", "4", "--seq-length", "256", *variant.split()])
        if i == 0:
            init.initialize(args)
        init.set_seeds(args.seed, cpu=True)
        np.savez(os.path.join(out_dir, f"variant{i}.npz"), **_leakage(args, prefix))
    init.shutdown()


def _leakage(args, prefix: str) -> dict:
    import numpy as np
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.training import data as D
    from megatron.training import model as M
    from megatron.training.indexed_io import open_dataset

    config = M.transformer_config(args, use_cpu=True)
    model = M.build_model(args, config, 256)[0].module.eval()
    ds = open_dataset(prefix)
    # the first docs of the dataset that fit, whole, in one micro-batch
    segments, total = [], 0
    for d, n in enumerate(ds.sequence_lengths[:64]):
        if total + n > args.seq_length:
            break
        segments.append((d, 0, int(n)))
        total += int(n)
    mb = D.build_microbatch(ds, np.arange(len(ds)), segments)
    cu = mb["cu_seqlens"]

    def logits(tokens):
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
                                 max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
        with torch.no_grad():
            return model(tokens, mb["position_ids"], None, packed_seq_params=packed).double().numpy()

    before = logits(mb["tokens"])
    changed = len(segments) // 2
    tokens = mb["tokens"].clone()
    s, e = int(cu[changed]), int(cu[changed + 1])
    tokens[0, s:e] = (tokens[0, s:e] + 7) % 256
    after = logits(tokens)
    rope = getattr(model, "rotary_pos_emb", None)
    rotary_dim = 2 * rope.inv_freq.numel() if rope is not None else 0
    return dict(before=before, after=after, cu=cu.numpy(), changed=changed, rotary_dim=rotary_dim)


if __name__ == "__main__":
    main()
