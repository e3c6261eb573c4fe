"""The cluster example runs SparseBalance for real (issue 62 item 5), checked by its dry run.

``examples/slurm/pretrain_sparsebalance.sbatch --dry-run`` prints the commands it would
run (no Slurm needed). The resolved ``pretrain_gpt.py`` line must turn SparseBalance on at
block 128 on the fa4 kernels with a Hugging Face tokenizer and TE layers, plan from a cost
model or a profile, and be ACCEPTED by ``tools/check_launch_script.py --cuda --te`` (the
trainer's own parse and validation, as on a GPU node with Transformer Engine) on the
world size the script's torchrun line gives. tests/integration/test_slurm.py runs the
same script under a real one-node Slurm cluster.
"""

import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SBATCH = os.path.join(ROOT, "examples", "slurm", "pretrain_sparsebalance.sbatch")


def dry_run(tmp_path, extra_env=None, args=()):
    from megatron.training.indexed_io import write_documents

    data = str(tmp_path / "corpus")
    write_documents(data, (np.arange(1, 200) % 250 for _ in range(4)), 256)
    env = dict(os.environ, DATA_PATH=data, TOKENIZER_MODEL=str(tmp_path / "tokenizer"),
               RUN_DIR=str(tmp_path / "run"), **(extra_env or {}))
    proc = subprocess.run(["bash", SBATCH, "--dry-run", *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    return lines, shlex.split(lines["pretrain_gpt.py"])


def value(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one wins, as in argparse


@pytest.mark.parametrize("planner", ["cost-model", "profile"])
def test_sbatch_trains_sparsebalance_and_the_trainer_accepts_it(tmp_path, capsys, planner):
    extra = {"PROFILE": "1", "VOCAB_SIZE": "256", "LENGTH_FILES": "a.json"} if planner == "profile" else {}
    lines, argv = dry_run(tmp_path, extra)
    assert "--sparse-balance" in argv
    assert value(argv, "--sb-block-size") == "128" and value(argv, "--sb-attention-backend") == "fa4"
    assert value(argv, "--tokenizer-type") == "HuggingFaceTokenizer"
    assert value(argv, "--transformer-impl") == "transformer_engine"
    if planner == "profile":
        assert value(argv, "--sb-profile") in lines["profile"] and "tools/profile_latency.py" in lines["profile"]
        return  # the profile is written by the job's first step: nothing to validate against here
    assert value(argv, "--sb-cost-model") == "h100-analytic"
    script = tmp_path / "resolved.sh"
    script.write_text(f"{lines['torchrun']} pretrain_gpt.py {lines['pretrain_gpt.py']}\n")
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import check_launch_script as tool

    code = tool.main(["--cuda", "--te", str(script)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.startswith("ACCEPTED on CUDA + Transformer Engine, 16 rank(s): trains 24 layers"), out
    assert "sparse attention block 128 top-k 32 (fa4), SparseBalance" in out


def test_arguments_after_the_script_override(tmp_path):
    _, argv = dry_run(tmp_path, args=["--train-iters", "5"])
    assert value(argv, "--train-iters") == "5"
