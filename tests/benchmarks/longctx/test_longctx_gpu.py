"""examples/longctx/gpu.sh: its settings, argument handling, and the process layout it
hands to train_arm.sh (checked with a stand-in torchrun that records its command line).
The full run needs a GPU; the tiny CPU path is run_all.sh's, tested end to end in
test_longctx_recipe.py."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HERE = os.path.join(REPO, "examples", "longctx")


def _env(**kw):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BASE_DIR")}
    for k in ("NPROC", "PP", "DEVICE_FLAGS", "PROFILE_DEVICE_FLAGS", "BUDGET_S", "RUNS_DIR", "DATA_DIR",
              "RESULT_FILE", "CURRICULUM", "OMP_NUM_THREADS"):
        env.pop(k, None)
    env.update(kw)
    return env


def _config(*args, **env) -> dict:
    p = subprocess.run(["bash", os.path.join(HERE, "gpu.sh"), *args, "--print-config"], capture_output=True,
                       text=True, env=_env(**env), timeout=60)
    assert p.returncode == 0, p.stderr
    return dict(line.split("=", 1) for line in p.stdout.splitlines())


def test_gpu_settings():
    c = _config()
    assert (c["NPROC"], c["PP"], c["DEVICE_FLAGS"], c["PROFILE_DEVICE_FLAGS"]) == ("1", "1", "", "")
    assert (c["NUM_LAYERS"], c["HIDDEN"], c["SEQ_LENGTH"], c["MAX_POSITIONS"]) == ("8", "512", "8192", "8192")
    assert c["RESULT_FILE"] == os.path.join(REPO, "results", "longctx_accuracy.json")
    assert c["CURRICULUM"] == os.path.join(HERE, "stages_gpu.json")
    assert c["ARMS"] == "dense megatron sparsebalance" and c["NEEDLE_LENGTH"] == "4096"
    assert "--cpu" not in c["LAUNCH"] and "--nproc-per-node 1 " in c["LAUNCH"]
    # a quarter of the context per query: (top-k + 2) x block = 2048 of 8192 keys
    assert (int(c["SB_TOPK"]) + 2) * int(c["SB_BLOCK"]) * 4 == int(c["SEQ_LENGTH"])
    assert _config(BUDGET_S="300")["BUDGET_S"] == "300"  # the environment still wins


def test_tiny_settings_are_the_cpu_layout():
    c = _config("--tiny")
    assert (c["NPROC"], c["PP"]) == ("2", "2") and "--cpu" in c["DEVICE_FLAGS"]
    assert c["RESULT_FILE"].startswith(os.path.join(REPO, "runs", "longctx-gpu-tiny"))
    assert int(c["NUM_LAYERS"]) <= 2 and int(c["SEQ_LENGTH"]) <= 1024


def test_gpu_stage_file_is_valid():
    p = subprocess.run([sys.executable, os.path.join(HERE, "curriculum.py"), "--stages",
                        os.path.join(HERE, "stages_gpu.json"), "--runs-dir", "/nonexistent/runs", "--status"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert len([ln for ln in p.stdout.splitlines() if "to do" in ln]) == 4


def test_bad_argument_and_missing_gpu(tmp_path):
    p = subprocess.run(["bash", os.path.join(HERE, "gpu.sh"), "--fast"], capture_output=True, text=True,
                       env=_env(), timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "gpu.sh: error: unknown argument --fast (expected --tiny or --print-config)"]
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu.sh would run the comparison")
    runs = tmp_path / "runs"
    p = subprocess.run(["bash", os.path.join(HERE, "gpu.sh")], capture_output=True, text=True,
                       env=_env(RUNS_DIR=str(runs), DATA_DIR=str(tmp_path / "data")), timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "no CUDA GPU" in lines[0] and "--tiny" in lines[0]
    assert not runs.exists() and not (tmp_path / "data").exists()


FAKE_TORCHRUN = """#!/usr/bin/env bash
echo "$@" > "$FAKE_ARGS"
"""


@pytest.mark.parametrize("layout", ["gpu", "cpu"])
def test_train_arm_launches_with_the_configured_layout(tmp_path, layout):
    sys.path.insert(0, REPO)
    from megatron.training.indexed_io import write_documents

    data = tmp_path / "data"
    data.mkdir()
    write_documents(str(data / "train_text_document"), [np.arange(1, 50), np.arange(1, 70)], 256)
    fake = tmp_path / "torchrun"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = _env(TORCHRUN=str(fake), FAKE_ARGS=str(tmp_path / "args"), DATA_DIR=str(data),
               RUNS_DIR=str(tmp_path / "runs"), CURRICULUM="none", BUDGET_S="60")
    if layout == "gpu":
        env.update(NPROC="1", PP="1", DEVICE_FLAGS="", PROFILE_DEVICE_FLAGS="")
    p = subprocess.run(["bash", os.path.join(HERE, "train_arm.sh"), "dense", "1"], capture_output=True,
                       text=True, env=env, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    argv = (tmp_path / "args").read_text().split()
    i = argv.index("--nproc-per-node")
    assert argv[i + 1] == ("1" if layout == "gpu" else "2") and argv[i + 2] == "pretrain_gpt.py"
    pp = argv[argv.index("--pipeline-model-parallel-size") + 1]
    assert pp == ("1" if layout == "gpu" else "2")
    assert ("--cpu" in argv) == (layout == "cpu") and ("gloo" in argv) == (layout == "cpu")
    assert "--exit-signal-handler" in argv  # the budget stop is the same on both
