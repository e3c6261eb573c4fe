"""--smeared-keys through the driver: a checkpoint trained without it fine-tunes with it
(the new weights start at 0), PP=2 computes what PP=1 does, and a smeared checkpoint
refuses to load into a model without them."""

import glob
import json
import os

import numpy as np

from conftest import HARNESS, PRETRAIN, TINY, launch, summary_of


def test_plain_checkpoint_finetunes_with_smeared_keys_in_both_layouts(corpus, tmp_path):
    init = str(tmp_path / "init")
    summary_of(launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "1", "--save", init]))
    runs = {}
    for name, nproc, extra in (("pp1", 1, []), ("pp2", 2, ["--pipeline-model-parallel-size", "2"])):
        dump = str(tmp_path / name)
        proc = launch(HARNESS, [*TINY, *extra, "--smeared-keys", "--data-path", corpus, "--train-iters", "3",
                                "--load", init, "--finetune", "--save", str(tmp_path / f"{name}-ckpt")],
                      nproc=nproc, extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "has no smeared-key weights; --smeared-keys starts them at 0" in proc.stdout
        grads = {}
        for f in sorted(glob.glob(os.path.join(dump, "rank*.npz"))):
            with np.load(f) as z:
                grads.update({k: z[k] for k in z.files})
        runs[name] = (json.load(open(os.path.join(dump, "rank0.json"))), grads)
    (ref, ref_grads), (got, got_grads) = runs["pp1"], runs["pp2"]
    smear = sorted(k for k in ref_grads if k.endswith("core_attention.key_smear"))
    assert len(smear) == 4 and sorted(got_grads) == sorted(ref_grads)  # one per layer, 4 layers
    for k in smear:
        assert ref_grads[k].shape == (4,) and np.abs(ref_grads[k]).min() > 0, k
        assert np.allclose(got_grads[k], ref_grads[k], rtol=1e-4, atol=1e-9), k
    assert np.allclose(got["losses"], ref["losses"], rtol=1e-5) and len(set(ref["losses"])) == 3

    # The smeared checkpoint loads with the flag (no message: its weights are there) and
    # is refused without it, in one line.
    ok = launch(PRETRAIN, [*TINY, "--smeared-keys", "--data-path", corpus, "--train-iters", "1",
                           "--load", str(tmp_path / "pp1-ckpt"), "--finetune"])
    summary_of(ok)
    assert "smeared-key weights" not in ok.stdout
    bad = launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "1",
                            "--load", str(tmp_path / "pp1-ckpt"), "--finetune"])
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "trained with --smeared-keys; pass --smeared-keys" in bad.stderr.strip().splitlines()[-1]
