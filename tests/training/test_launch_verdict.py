"""tools/check_launch_script.py's verdict is the trainer's (issue 62 item 2).

Twelve launch lines (the three held-out launch scripts whole, and lines with refused and
target-dependent combinations) are judged twice in this process: by
``launch_verdict.judge`` (what the tool prints) and by the trainer's own ``parse_args``,
on this machine and on an emulated GPU node with Transformer Engine. For the trainer the
GPU node is made by hand (``torch.cuda.is_available`` answers True, a stand-in
``transformer_engine`` module is importable), independently of the checker's emulation.
Accepted or refused, and the error line, must agree. Parsing only: no training.
"""

import contextlib
import importlib.machinery
import os
import sys
import types

import pytest
from conftest import ROOT
from test_launch_scripts import SCRIPTS, make_tokenizer_files, script_text

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--train-iters", "2"]
LINES = {  # name -> (extra flags, world size); the three scripts are added by the fixture
    "plain": ([], 1),
    "te with sparse balance": (["--transformer-impl", "transformer_engine", "--sparse-balance",
                                "--sb-cost-model", "h100-analytic"], 1),
    "bf16": (["--bf16"], 1),
    "fp8 on te layers only": (["--fp8-format", "hybrid"], 1),
    "world not divisible by tp": (["--tensor-model-parallel-size", "2"], 1),
    "iters and samples both": (["--train-samples", "8"], 1),
    "flash backend with local layers": (["--attention-backend", "flash"], 1),
    "te with context parallelism": (["--transformer-impl", "transformer_engine", "--context-parallel-size", "2"], 2),
    "sparse balance without a predictor": (["--sparse-balance"], 1),
}


@pytest.fixture(scope="module")
def lines(corpus, tmp_path_factory):
    from megatron.training.launch_verdict import expand_variables, launch_line, smallest_world

    d = str(tmp_path_factory.mktemp("verdict"))
    variables = dict(make_tokenizer_files(d), DATA_PATH=corpus, DATA_PATH2=corpus, CACHE_DIR=os.path.join(d, "c"))
    out = {name: ([*BASE, "--data-path", corpus, *extra], world) for name, (extra, world) in LINES.items()}
    for name in SCRIPTS:
        text, unset = expand_variables(script_text(name, variables, os.path.join(d, name[:-3])), {})
        assert not unset, unset
        argv, world = launch_line(text)
        out[name] = (argv, world or smallest_world(argv))
    return out


@contextlib.contextmanager
def gpu_node_with_te(monkeypatch):
    """What the trainer's probes see on a GPU node with Transformer Engine installed."""
    import torch

    te = types.ModuleType("transformer_engine")
    te.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setitem(sys.modules, "transformer_engine", te)
        yield


def trainer_verdict(argv, world, capsys):
    from megatron.training.arguments import parse_args

    capsys.readouterr()
    try:
        parse_args(argv, world_size=world)
    except SystemExit as e:
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert e.code == 2 and len(lines) == 1, lines
        return False, lines[0].removeprefix("pretrain_gpt.py: error: ")
    return True, None


@pytest.mark.parametrize("target", ["cpu", "cuda+te"])
def test_checker_verdict_equals_the_trainers(lines, target, capsys, monkeypatch):
    from megatron.training.launch_verdict import Target, judge

    assert len(lines) == 12
    accepted = []
    for name, (argv, world) in sorted(lines.items()):
        mine = judge(argv, world, Target(cuda=target == "cuda+te", te=target == "cuda+te"))
        trainer_verdict(argv, world, capsys)  # first parse imports what validation needs, unpatched
        with gpu_node_with_te(monkeypatch) if target == "cuda+te" else contextlib.nullcontext():
            theirs = trainer_verdict(argv, world, capsys)
        assert (mine.accepted, mine.error) == theirs, name
        accepted.append(mine.accepted)
    assert 3 <= sum(accepted) <= len(accepted) - 3, accepted  # both verdicts occur: not vacuous


def test_verdicts_that_depend_on_the_target(lines):
    """The same line, two machines: bf16, FP8 and the whole Llama-3 script (minus FP8) train on
    a GPU only; TE with CP trains with the local spec on both, saying why (this driver's CP
    attention lives there; the CPU lacks TE besides)."""
    from megatron.training.launch_verdict import Target, judge

    cpu, gpu = Target(), Target(cuda=True, te=True)
    bf16 = lines["bf16"]
    assert not judge(*bf16, cpu).accepted and judge(*bf16, gpu).accepted
    cp = lines["te with context parallelism"]
    on_cpu, on_gpu = judge(*cp, cpu), judge(*cp, gpu)
    assert on_cpu.accepted and on_gpu.accepted
    assert any("CUDA and the transformer_engine package missing" in w for w in on_cpu.warnings)
    assert any("context-parallel attention lives in the local spec" in w for w in on_gpu.warnings)
    fp8 = lines["fp8 on te layers only"]  # FP8 GEMMs are Transformer Engine's (megatron/training/fp8.py)
    assert judge(*fp8, gpu).accepted
    assert "--fp8-format: needs Transformer Engine's layers on a CUDA GPU" in judge(*fp8, cpu).error


def test_the_tool_judges_the_whole_line(tmp_path, capsys):
    """The issue's case: a script whose flags each pass alone; the tool refuses the line on
    the GPU target (the FP8 output projection is refused there too), exits 1, and the share
    honoured is below 1; without it the line is accepted, with the warning the trainer prints."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import check_launch_script as tool

    line = ("torchrun --nproc_per_node 4 --nnodes 1 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
            "--num-attention-heads 4 --seq-length 128 --tensor-model-parallel-size 2 "
            "--pipeline-model-parallel-size 2 --sequence-parallel --untie-embeddings-and-output-weights "
            "--transformer-impl transformer_engine --bf16 --train-iters 2 --mock-data "
            "--sparse-balance --sb-cost-model h100-analytic")
    script = tmp_path / "run.sh"
    script.write_text(line + " --fp8-format hybrid --fp8-output-proj\n")
    assert tool.main(["--cuda", "--te", str(script)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("REFUSED on CUDA + Transformer Engine, 4 rank(s): --fp8-output-proj")
    assert len(out.splitlines()) < 10
    report = tool.report(script.read_text(), cuda=True, te=True)
    assert report["honoured_fraction"] < 1.0 and report["counts"]["unsupported"] == 1
    script.write_text(line + "\n")
    assert tool.main(["--cuda", "--te", str(script)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ACCEPTED on CUDA + Transformer Engine, 4 rank(s): trains ")
    assert "TP 2 PP 2 CP 1 DP 1; transformer_engine layers, bf16; sparse attention" in out
    assert tool.main([str(script)]) == 1  # this machine: --bf16 needs CUDA
    out = capsys.readouterr().out
    assert "--bf16 needs CUDA" in out.splitlines()[0] and "without --bf16: ACCEPTED" in out
