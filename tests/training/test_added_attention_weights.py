"""--smeared-keys and --qk-conv through the driver: a checkpoint trained without them
fine-tunes with them (the new weights start as a no-op), PP=2 computes what PP=1 does, and
a checkpoint with them refuses to load into a model without them."""

import glob
import json
import os

import numpy as np
import pytest

from conftest import HARNESS, PRETRAIN, TINY, launch, summary_of

# flags, added weights (name suffix: shape per layer), load message, refusal
SMEAR = (["--smeared-keys"], {"core_attention.key_smear": (4,)},
         "has no smeared-key weights; --smeared-keys starts them at 0",
         "trained with --smeared-keys; pass --smeared-keys")
QK_CONV = (["--qk-conv", "3"], {"core_attention.query_conv": (3, 4, 16), "core_attention.key_conv": (3, 4, 16)},
           "has no qk-conv taps; --qk-conv starts them as the identity",
           "trained with --qk-conv; pass --qk-conv N")


@pytest.mark.parametrize("flags, added, message, refusal", [SMEAR, QK_CONV], ids=["smeared-keys", "qk-conv"])
def test_plain_checkpoint_finetunes_with_added_weights_in_both_layouts(corpus, tmp_path, flags, added,
                                                                       message, refusal):
    init = str(tmp_path / "init")
    summary_of(launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "1", "--save", init]))
    runs = {}
    for name, nproc, extra in (("pp1", 1, []), ("pp2", 2, ["--pipeline-model-parallel-size", "2"])):
        dump = str(tmp_path / name)
        proc = launch(HARNESS, [*TINY, *extra, *flags, "--data-path", corpus, "--train-iters", "3",
                                "--load", init, "--finetune", "--save", str(tmp_path / f"{name}-ckpt")],
                      nproc=nproc, extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert message in proc.stdout
        grads = {}
        for f in sorted(glob.glob(os.path.join(dump, "rank*.npz"))):
            with np.load(f) as z:
                grads.update({k: z[k] for k in z.files})
        runs[name] = (json.load(open(os.path.join(dump, "rank0.json"))), grads)
    (ref, ref_grads), (got, got_grads) = runs["pp1"], runs["pp2"]
    assert sorted(got_grads) == sorted(ref_grads)
    for suffix, shape in added.items():
        names = sorted(k for k in ref_grads if k.endswith(suffix))
        assert len(names) == 4, names  # one per layer, 4 layers
        for k in names:
            assert ref_grads[k].shape == shape, k
            assert np.abs(ref_grads[k]).reshape(shape[0], -1).max(axis=1).min() > 0, k  # every head / tap
            assert np.allclose(got_grads[k], ref_grads[k], rtol=1e-4, atol=1e-9), k
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-5) and len(set(ref["losses"])) == 3

    # The checkpoint loads with the flag (no message: its weights are there) and is
    # refused without it, in one line.
    ok = launch(PRETRAIN, [*TINY, *flags, "--data-path", corpus, "--train-iters", "1",
                           "--load", str(tmp_path / "pp1-ckpt"), "--finetune"])
    summary_of(ok)
    assert message.split(";")[0] not in ok.stdout
    bad = launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "1",
                            "--load", str(tmp_path / "pp1-ckpt"), "--finetune"])
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert refusal in bad.stderr.strip().splitlines()[-1]
