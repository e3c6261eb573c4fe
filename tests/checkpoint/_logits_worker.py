"""Our GPTModel's logits for packed documents, from a converted checkpoint.

    python _logits_worker.py TOKENS.npy CU_SEQLENS.npy CKPT OUT.npy [CKPT OUT.npy ...]

For each checkpoint, builds the model from ``CKPT/model_flags.txt`` (TP=PP=1, fp32, CPU), loads it as
``pretrain_gpt.py --finetune`` does, and runs one THD forward (dense attention).
"""

import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    import numpy as np
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.checkpointing import load_weights
    from megatron.training.initialize import shutdown
    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    from convert import _build, _model_args

    tokens = torch.from_numpy(np.load(sys.argv[1])).long()[None]
    cu = torch.from_numpy(np.load(sys.argv[2])).int()
    pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(cu[:-1], cu[1:])])[None]
    max_len = int((cu[1:] - cu[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    jobs = sys.argv[3:]
    for ckpt, out in zip(jobs[::2], jobs[1::2]):
        args = _model_args(open(os.path.join(ckpt, "model_flags.txt")).read().split())
        model = _build(args)
        try:
            load_weights(ckpt, [types.SimpleNamespace(module=model)])
            model.eval()
            with torch.no_grad():
                logits = model(tokens, pos, None, packed_seq_params=packed)
            np.save(out, logits.reshape(tokens.shape[1], -1).double().numpy())
        finally:
            shutdown()


if __name__ == "__main__":
    main()
