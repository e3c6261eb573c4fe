"""Our GPTModel's logits for packed documents, from a converted checkpoint.

    python _logits_worker.py TOKENS.npy CU_SEQLENS.npy CKPT OUT.npy [CKPT OUT.npy ...]

For each checkpoint, builds the model from ``CKPT/model_flags.txt`` (TP=PP=1, fp32, CPU), loads it as
``pretrain_gpt.py --finetune`` does, and runs one THD forward (dense attention):
``tools/checkpoint/check_real_model.py``'s ``driver_logits``.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main():
    import numpy as np

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    sys.path.insert(0, os.path.join(ROOT, "tools", "checkpoint"))
    from check_real_model import driver_logits

    tokens, cu = np.load(sys.argv[1]), np.load(sys.argv[2])
    jobs = sys.argv[3:]
    for ckpt, out in zip(jobs[::2], jobs[1::2]):
        np.save(out, driver_logits(ckpt, tokens, cu))


if __name__ == "__main__":
    main()
