"""Megatron-LM's logging flags: ``--log-params-norm`` (the parameters' L2 norm after each
step), ``--log-num-zeros-in-grad`` (zeros in the step's gradients) and
``--log-validation-ppl-to-tensorboard`` (validation perplexity): in the log line, in
tensorboard and in ``--summary-json``."""

import math
import re

import pytest
import torch
from conftest import PRETRAIN, TINY, launch, summary_of


def test_params_norm_zeros_and_validation_ppl(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    flags = [*TINY, "--data-path", corpus, "--train-iters", "3", "--log-params-norm", "--log-num-zeros-in-grad",
             "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", str(tb), "--eval-interval", "3",
             "--eval-iters", "1", "--summary-json", str(tmp_path / "s.json")]
    proc = launch(PRETRAIN, flags)
    s = summary_of(proc)
    norms, zeros = s["params_norms"], s["num_zeros_in_grad"]
    assert len(norms) == len(zeros) == 3
    assert all(math.isfinite(n) and n > 0 for n in norms)
    assert len(set(norms)) == 3  # each update moves the parameters
    assert all(z >= 0 and z == int(z) for z in zeros)
    logged = [float(x) for x in re.findall(r"\| params norm ([0-9.]+)", proc.stdout)]
    assert logged == pytest.approx(norms, abs=1e-3)
    assert len(re.findall(r"\| num zeros \d+", proc.stdout)) == 3
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"params-norm", "num-zeros", "validation-loss", "validation-ppl"} <= set(tags)
    loss = acc.Scalars("validation-loss")[-1].value
    assert acc.Scalars("validation-ppl")[-1].value == pytest.approx(math.exp(min(20.0, loss)), rel=1e-5)


def test_without_the_flags_nothing_is_computed(corpus, tmp_path):
    s = summary_of(launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "1"]))
    assert s["params_norms"] is None and s["num_zeros_in_grad"] is None


def test_params_norm_skips_shared_copies(mp):
    from megatron.training.step import params_l2_norm

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    b.weight.shared = True  # a tied copy (the last stage's output embedding): counted once, elsewhere
    want = math.sqrt(sum(float(p.detach().double().square().sum()) for p in (a.weight, a.bias, b.bias)))
    assert params_l2_norm([a, b]) == pytest.approx(want, rel=1e-12)
