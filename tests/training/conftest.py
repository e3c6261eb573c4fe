"""Fixtures for the driver tests: a tiny corpus and launch helpers.

Every launch uses OMP_NUM_THREADS=1 and the tiny GPT of :data:`TINY`.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # worker scripts import this file without the test session's path
    sys.path.insert(0, ROOT)
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402

PY = sys.executable
HARNESS = os.path.join(ROOT, "tests", "training", "_harness.py")
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")

TINY = [*PROJECT_RUN_FLAGS, "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--seq-length", "256", "--global-batch-size", "4",
        "--lr", "1e-3", "--log-interval", "1", "--no-progress-bar", "--seed", "7"]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def command(script, args=()):
    """``python SCRIPT ARGS``."""
    return [PY, script, *args]


def torchrun(script, args=(), nproc=2):
    """``torchrun --nproc-per-node NPROC --standalone SCRIPT ARGS`` (each rank as :func:`command`)."""
    return [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
            *command(script, args)[1:]]


def launch(script, args, nproc=1, timeout=240, extra_env=None):
    """Run ``script`` with ``args`` under python (nproc=1) or torchrun; returns CompletedProcess."""
    cmd = command(script, args) if nproc == 1 else torchrun(script, args, nproc)
    e = env()
    e.update(extra_env or {})
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def summary_of(proc):
    """The SUMMARY_JSON line rank 0 prints."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "SUMMARY_JSON " in ln]
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0].split("SUMMARY_JSON ", 1)[1])


def make_test_corpus(prefix: str, num_docs: int, max_length: int, world=None) -> str:
    """Write a synthetic corpus (prolong lengths scaled to <= max_length) at ``prefix``
    (in ``world``, the session's warm world, if given; else in a process)."""
    script = os.path.join(ROOT, "tools", "make_corpus.py")
    args = ["--output-prefix", prefix, "--num-docs", str(num_docs), "--max-length", str(max_length),
            "--quantile", "0.99"]
    if world is not None:
        proc = world.launch(script, args, timeout=120)
    else:
        proc = subprocess.run(command(script, args), cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode == 0, proc.stderr
    return prefix


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, world):
    """~300 documents, prolong lengths scaled to <= 384 tokens (some exceed --seq-length 256)."""
    return make_test_corpus(str(tmp_path_factory.mktemp("corpus") / "tiny"), 300, 384, world)


@pytest.fixture(scope="session")
def long_corpus(tmp_path_factory, world):
    """Documents up to 1024 tokens (many longer than the top-k cap of 192 tokens at block 32)."""
    return make_test_corpus(str(tmp_path_factory.mktemp("long") / "c"), 400, 1024, world)


def balancer_config(pp=2, policy="critical-path", plan_ahead=True, topk=4, topk_min=2, topk_max=8,
                    **dst):
    """A SparseBalanceConfig with what a Balancer reads (sparse attention, DST, layout)."""
    from sparsebalance.config import AttentionConfig, DSTConfig, ModelShape, ParallelConfig, SparseBalanceConfig

    model = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                       ffn_hidden_size=128, vocab_size=256, swiglu=False, block_size=64, topk=topk)
    return SparseBalanceConfig(model=model, attention=AttentionConfig(sparse=True, topk=topk),
                               dst=DSTConfig(policy=policy, topk_min=topk_min, topk_max=topk_max,
                                             plan_ahead=plan_ahead, **dst),
                               parallel=ParallelConfig(pp=pp))


def parsed(quiet, *flags, world_size=1):
    """The driver's resolved arguments for ``quiet`` + ``flags``."""
    from megatron.training.arguments import parse_args

    return parse_args([*quiet, *flags], world_size=world_size)


def refused_line(capsys, quiet, *flags, world_size=1) -> str:
    """The one error line (exit 2) the driver's parse gives ``quiet`` + ``flags``."""
    import pytest

    with pytest.raises(SystemExit) as e:
        parsed(quiet, *flags, world_size=world_size)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]
