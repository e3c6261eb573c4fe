"""Megatron-LM's logging flags: ``--log-params-norm`` (the parameters' L2 norm after each
step), ``--log-num-zeros-in-grad`` (zeros in the step's gradients) and
``--log-validation-ppl-to-tensorboard`` (validation perplexity): in the log line, in
tensorboard and in ``--summary-json``; ``--wandb-project`` and its flags: the same scalars
to an offline Weights & Biases run, and their one-line refusals."""

import importlib.machinery
import json
import math
import os
import re
import sys

import pytest
import torch
from conftest import PRETRAIN, TINY, launch, summary_of

from megatron.training.arguments import parse_args

WANDB_CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_wandb_calls.py")
QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local"]


def test_params_norm_zeros_and_validation_ppl(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, wb, calls = tmp_path / "tb", tmp_path / "wb", tmp_path / "wandb_calls.jsonl"
    flags = [*TINY, "--data-path", corpus, "--train-iters", "3", "--log-params-norm", "--log-num-zeros-in-grad",
             "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", str(tb), "--eval-interval", "3",
             "--eval-iters", "1", "--summary-json", str(tmp_path / "s.json"),
             "--wandb-project", "sb-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(wb)]
    # the same run, with the real wandb's Run.log recording what the driver hands it
    proc = launch(WANDB_CALLS, [PRETRAIN, *flags],
                  extra_env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "SB_TEST_WANDB_CALLS": str(calls)})
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

    # W&B: one offline run under --wandb-save-dir, each step's scalars under Megatron-LM's names
    runs = list((wb / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and len(list(runs[0].glob("run-*.wandb"))) == 1
    assert next(runs[0].glob("run-*.wandb")).stat().st_size > 0
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    train = [c for c in logged if "lm loss" in c["data"]]
    assert [c["step"] for c in train] == [1, 2, 3]
    assert [c["data"]["lm loss"] for c in train] == s["losses"]  # exactly what the driver logged
    assert [c["data"]["grad-norm"] for c in train] == s["grad_norms"]
    assert [c["data"]["params-norm"] for c in train] == norms
    assert {"learning-rate", "iteration-time", "num-zeros", "tokens-per-s"} <= set(train[0]["data"])
    printed = [float(x) for x in re.findall(r"\| loss ([0-9.]+)", proc.stdout)]
    assert printed == pytest.approx([c["data"]["lm loss"] for c in train], abs=1e-4)
    valid = [c for c in logged if "lm loss validation" in c["data"]]
    assert len(valid) == 1 and valid[0]["step"] == 3
    assert valid[0]["data"]["lm loss validation"] == pytest.approx(loss, rel=1e-6)
    assert valid[0]["data"]["lm loss validation ppl"] == pytest.approx(math.exp(min(20.0, loss)), rel=1e-5)


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


def _refused(capsys, *flags):
    with pytest.raises(SystemExit) as e:
        parse_args([*QUIET, *flags], world_size=1)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_wandb_flags_refused_where_megatron_lm_fails(capsys, monkeypatch):
    # Megatron-LM's last rank: os.path.join(args.save, 'wandb') with no --save, its ValueError for
    # an empty experiment name, `import wandb` without the package
    assert "needs --wandb-save-dir or --save" in _refused(capsys, "--wandb-project", "p")
    assert "--wandb-exp-name is empty" in _refused(capsys, "--wandb-project", "p", "--save", "x",
                                                   "--wandb-exp-name", "")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: find_spec says None
    assert "needs the wandb package" in _refused(capsys, "--wandb-project", "p", "--wandb-save-dir", "x")
    args = parse_args([*QUIET, "--wandb-save-dir", "x"], world_size=1)  # no project: W&B is off
    assert args.wandb_project is None and not any("wandb" in w for w in args.compat_warnings)


def test_wandb_run_only_on_the_last_rank(tmp_path, monkeypatch):
    from megatron.training import wandb_log

    opened, fake = [], type(sys)("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: opened.append(kw) or "run"
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = parse_args([*QUIET, "--wandb-project", "p", "--wandb-entity", "team", "--save", str(tmp_path)],
                      world_size=1)
    assert wandb_log.open_run(args, rank=0, world_size=2) is None and not opened
    assert wandb_log.open_run(args, rank=1, world_size=2) == "run"
    (kw,) = opened
    assert (kw["project"], kw["name"], kw["entity"], kw["dir"]) == ("p", None, "team", str(tmp_path / "wandb"))
    assert kw["config"]["wandb_project"] == "p" and not any(k.startswith("mlm__") for k in kw["config"])
    args.wandb_project = None
    assert wandb_log.open_run(args, rank=1, world_size=2) is None
