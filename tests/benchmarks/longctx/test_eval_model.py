"""The model side of benchmarks/eval_longctx.py on a real (tiny, random) megatron-core GPT:
packed THD sequences do not see each other, and logits are causal, which is what
makes the one-forward greedy mode equal to token-by-token decoding."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_logits_are_isolated_and_causal():
    p = subprocess.run([sys.executable, os.path.join(HERE, "model_probe.py")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    facts = json.loads(p.stdout.strip().splitlines()[-1])
    assert facts["shapes"] == [[150, 256], [90, 256]]
    assert facts["scale"] > 0.1  # the logits are not trivially zero
    assert facts["isolation"] <= 1e-4 * facts["scale"]
    assert facts["causal"] <= 1e-4 * facts["scale"]
