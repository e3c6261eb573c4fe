"""examples/real/gpu.sh (continue-pretraining a real model with SparseBalance on one GPU, then
benchmarks/real_accuracy.py before and after), on the CPU: its dry run's steps fit one 8-minute
lease, and the training command's flags are the driver's."""

import os
import shlex
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "real", "gpu.sh")


def _dry(**env):
    p = subprocess.run(["bash", SCRIPT, "--dry-run"], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    steps = {ln.split(":", 1)[0]: ln.split(": ", 1)[1] for ln in lines[:-1]}
    return steps, int(lines[-1].split()[1])


@pytest.mark.parametrize("env, order, seq", [
    ({}, ["corpus", "base", "train", "eval"], "8192"),
    ({"MODEL": "qwen2.5", "HF_DIR": "/models/Qwen2.5-0.5B"}, ["convert", "corpus", "base", "train", "eval"], "32768"),
])
def test_dry_run_fits_eight_minutes(env, order, seq):
    steps, total = _dry(**env)
    assert list(steps) == order
    budgets = [int(c.split()[1]) for c in steps.values()]
    assert sum(budgets) == total <= 8 * 60
    train = steps["train"]
    for flag in ("--finetune", "--sparse-balance", "--sb-cost-model h100-analytic", f"--seq-length {seq}", "--save"):
        assert flag in train
    assert "--load" in steps["base"] and steps["eval"].split("--load ")[1].split()[0].endswith("/ft")


def test_train_flags_parse_with_the_driver():
    from megatron.training.arguments import build_parser

    steps, _ = _dry()
    argv = shlex.split(steps["train"].split("model_flags.txt)", 1)[1])
    args = build_parser().parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                      *argv])
    assert args.finetune and args.sparse_balance and args.sb_block_size == 128


@pytest.mark.parametrize("env, args, said", [
    ({"MODEL": "qwen2.5"}, ["--dry-run"], "gpu.sh: error: MODEL=qwen2.5 needs HF_DIR (a Qwen2.5 HF directory)"),
    ({}, ["--fast"], "gpu.sh: error: unknown argument --fast (expected --dry-run)"),
    ({"MODEL": "llama"}, ["--dry-run"], "gpu.sh: error: unknown MODEL llama (smollm2 or qwen2.5)"),
])
def test_bad_input_is_one_line(env, args, said):
    p = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **env))
    assert p.returncode == 2 and p.stdout == "" and p.stderr.strip().splitlines() == [said]
