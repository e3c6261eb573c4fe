#!/usr/bin/env python
"""sha256 fingerprints of the behaviour a refactor must keep, as one JSON object.

(a) The exact-resume test's run (tests/training/test_exact_resume.py: PP=2 over gloo,
``--sparse-balance``, analytic cost model, deterministic "measured" op times through
``tests/training/_fault_worker.py``), 5 steps with ``--summary-json``: hashes of every
rank's packing and sampler state, the DST budget tables, the attention records
(layer, micro-batch, top-k of every call), the losses, and the summary's key set.
The same 3-step run with dense attention under the megatron and the wlb packers:
packing and loss hashes (the driver's dense route).
(b) The quick comparison (``benchmarks/compare.py --mode sim --quick --json``): one hash per
arm over its tokens/s in every cell, plus one over the whole object.

Run it before and after a change that must not alter behaviour; the two outputs must
be equal (about 2 minutes on 2 CPU cores)::

    .venv/bin/python benchmarks/ci/behaviour_hashes.py > results/refactor_hashes_before.json
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
PY = sys.executable
WORKER = os.path.join(REPO, "tests", "training", "_fault_worker.py")
# test_exact_resume.py's FLAGS over tests/training/conftest.py's TINY
RUN_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
             "--num-attention-heads", "4", "--seq-length", "256", "--lr", "1e-3", "--log-interval", "1",
             "--no-progress-bar", "--seed", "7", "--pipeline-model-parallel-size", "2",
             "--lr-decay-style", "constant", "--global-batch-size", "6",
             "--sb-cost-model", "h100-analytic"]
SPARSE_FLAGS = ["--sparse-balance", "--sb-block-size", "32", "--sb-topk", "4", "--train-iters", "5"]
DENSE_ARMS = {"dense-megatron": ["--sb-batching", "megatron", "--train-iters", "3"],
              "dense-wlb": ["--sb-batching", "wlb", "--train-iters", "3"]}
DUMP_KEYS = ("packing", "sampler", "budget", "records", "loss")


def sha(obj) -> str:
    """sha256 of ``obj``'s canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(cmd, env=None) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"behaviour_hashes: {' '.join(cmd[:4])} ... failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def training_run(tmp: str, corpus: str, name: str, flags) -> dict:
    """Hashes of one 2-rank run of the worker with ``flags`` (see module docstring)."""
    from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

    dump, summary = os.path.join(tmp, f"dump_{name}"), os.path.join(tmp, f"summary_{name}.json")
    _run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", WORKER,
          *PROJECT_RUN_FLAGS, *RUN_FLAGS, *flags, "--data-path", corpus, "--summary-json", summary],
         env={**_env(), "SB_TEST_DET_TIMES": "1", "SB_TEST_DUMP": dump})
    steps = {}
    for name in sorted(os.listdir(dump)):
        rows = [json.loads(ln) for ln in open(os.path.join(dump, name))]
        steps[name] = [r for r in rows if "iteration" in r]
    pick = {"packing": ("packing",), "sampler": ("sampler",), "budget": ("budget",),
            "records": ("records",), "loss": ("loss_sum", "loss_tokens")}
    out = {k: sha({rank: [[s[f] for f in pick[k]] for s in rows] for rank, rows in steps.items()})
           for k in DUMP_KEYS}
    with open(summary) as f:
        out["summary_keys"] = sha(sorted(json.load(f)))
    return out


def training_hashes(tmp: str) -> dict:
    """The sparse-balance run's hashes, and the dense arms' packing and loss hashes."""
    corpus = os.path.join(tmp, "tiny")
    _run([PY, os.path.join(REPO, "tools", "make_corpus.py"), "--output-prefix", corpus,
          "--num-docs", "300", "--max-length", "384", "--quantile", "0.99"])
    out = training_run(tmp, corpus, "sparse-balance", SPARSE_FLAGS)
    for name, flags in DENSE_ARMS.items():
        run = training_run(tmp, corpus, name, flags)
        out[name] = {k: run[k] for k in ("packing", "loss", "summary_keys")}
    return out


def comparison_hashes() -> dict:
    """Hashes of the quick simulated comparison's per-arm results."""
    doc = json.loads(_run([PY, os.path.join(REPO, "benchmarks", "compare.py"), "--mode", "sim", "--quick",
                           "--json"]))
    arms = sorted({a for c in doc["cells"] for a in c["arms"]})
    out = {arm: sha([c["arms"].get(arm) for c in doc["cells"]]) for arm in arms}
    out["all"] = sha(doc)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="behaviour_hashes_") as tmp:
        result = {"training": training_hashes(tmp), "comparison": comparison_hashes()}
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
