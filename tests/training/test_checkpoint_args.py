"""Megatron-LM's checkpoint flags of continued-pretraining scripts: ``--use-checkpoint-args``,
``--ckpt-format torch`` (its legacy per-rank checkpoints), ``--padded-vocab-size``, and
``--save-interval`` / ``--no-save-optim`` without ``--save``.

One DP=1 run of TOTAL steps saves at AT twice: torch_dist (``--save``) and, through
``_legacy_worker.py``, a legacy ``--ckpt-format torch`` checkpoint as Megatron-LM writes it
(Transformer Engine's layer-norm names, its namespace as ``args``). Resuming the torch_dist
one with ``--use-checkpoint-args`` and no model flags continues the run exactly. Resuming
the legacy one (again without model flags) loads the very weights and Adam moments that
were saved, continues the iteration count and the LR schedule, and trains; its data order
starts over (a legacy checkpoint holds no data position), so its losses are not compared.
"""

import json
import os
import shutil

import numpy as np
import pytest
from conftest import ROOT, TINY

WORKER = os.path.join(ROOT, "tests", "training", "_legacy_worker.py")
TOTAL, AT = 4, 2
MODEL_FLAGS = {"--num-layers": 1, "--hidden-size": 1, "--ffn-hidden-size": 1, "--num-attention-heads": 1,
               "--position-embedding-type": 1, "--untie-embeddings-and-output-weights": 0}


def without_model_flags(argv):
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
        elif a in MODEL_FLAGS:
            skip = MODEL_FLAGS[a]
        else:
            out.append(a)
    return out


BASE = [*TINY, "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--train-iters", str(TOTAL)]


def _run(world, tmp, name, argv, extra_env=None):
    dump = tmp / f"d_{name}"
    proc = world.launch(WORKER, argv, nproc=1, extra_env={"SB_TEST_DUMP": str(dump), **(extra_env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(dump / "run.json")), proc


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory, world):
    tmp = tmp_path_factory.mktemp("ckargs")
    run, _ = _run(world, tmp, "full", [*BASE, "--data-path", corpus, "--save", str(tmp / "dist"),
                                       "--save-interval", str(AT)],
                  {"SB_TEST_LEGACY_SAVE": f"{tmp / 'legacy'}:{AT}"})
    shutil.rmtree(tmp / "dist" / f"iter_{TOTAL:07d}")  # the end-of-run save: resume at AT
    (tmp / "dist" / "latest_checkpointed_iteration.txt").write_text(f"{AT}\n")
    return run, tmp


def test_use_checkpoint_args_resumes_without_model_flags(saved, corpus, world):
    full, tmp = saved
    argv = without_model_flags(BASE)
    assert "--hidden-size" not in argv and "--untie-embeddings-and-output-weights" not in argv
    res, _ = _run(world, tmp, "dist", [*argv, "--data-path", corpus, "--load", str(tmp / "dist"),
                                       "--use-checkpoint-args", "--exit-on-missing-checkpoint"])
    assert [s["iteration"] for s in res["steps"]] == list(range(AT + 1, TOTAL + 1))
    np.testing.assert_allclose([s["loss"] for s in res["steps"]], [s["loss"] for s in full["steps"][AT:]],
                               rtol=1e-6)


def test_legacy_torch_checkpoint_loads_and_continues(saved, corpus, world):
    full, tmp = saved
    legacy = tmp / "legacy" / f"iter_{AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    assert legacy.is_file()
    res, proc = _run(world, tmp, "legacy", [*without_model_flags(BASE), "--data-path", corpus,
                                            "--load", str(tmp / "legacy"), "--ckpt-format", "torch",
                                            "--use-checkpoint-args"])
    assert res["loaded"] == full["saved"]  # the same weights and Adam moments (sums and squares)
    assert res["loaded"]["moments"][2] > 10
    assert [s["iteration"] for s in res["steps"]] == list(range(AT + 1, TOTAL + 1))
    assert [s["lr"] for s in res["steps"]] == [s["lr"] for s in full["steps"][AT:]]  # the LR schedule goes on
    assert all(np.isfinite(s["loss"]) for s in res["steps"])
    assert "holds no data position" in proc.stderr


def test_legacy_torch_checkpoint_finetunes(saved, corpus, world):
    """``--finetune`` takes a legacy checkpoint's weights; iteration and optimizer start fresh."""
    full, tmp = saved
    res, _ = _run(world, tmp, "legacy_ft", [*without_model_flags(BASE), "--data-path", corpus, "--finetune",
                                            "--load", str(tmp / "legacy"), "--ckpt-format", "torch",
                                            "--use-checkpoint-args"])
    assert res["loaded"]["params"] == full["saved"]["params"]
    assert [s["iteration"] for s in res["steps"]] == list(range(1, TOTAL + 1))


def _parse_error(argv, capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=1)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_use_checkpoint_args_mismatch_is_one_line(saved, corpus, capsys):
    _, tmp = saved
    for load in ("dist", "legacy"):
        line = _parse_error([*without_model_flags(BASE), "--data-path", corpus, "--load", str(tmp / load),
                             "--use-checkpoint-args", "--hidden-size", "96"], capsys)
        assert "--use-checkpoint-args: --hidden-size 96 on the command line, but the checkpoint" in line, line


def test_use_checkpoint_args_takes_the_checkpoints_model(saved, corpus):
    from megatron.training.arguments import parse_args

    _, tmp = saved
    for load in ("dist", "legacy"):
        args = parse_args([*without_model_flags(BASE), "--data-path", corpus, "--load", str(tmp / load),
                           "--use-checkpoint-args", "--seq-length", "128"], world_size=1)
        assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (4, 64, 128, 4)
        assert args.untie_embeddings_and_output_weights and args.position_embedding_type == "rope"
        assert args.seq_length == 128  # the command line's (context length is not a weight shape)
        assert args.padded_vocab_size is not None
        # dropout as trained: 0 here, Megatron-LM's 0.1 in the legacy one (its namespace), as it takes it
        assert args.hidden_dropout == args.attention_dropout == {"dist": 0.0, "legacy": 0.1}[load]


def test_padded_vocab_size_honoured_or_refused(corpus):
    from megatron.training.arguments import parse_args
    from megatron.training.tokenizer import args_vocab_size, model_vocab_size

    args = parse_args([*TINY, "--data-path", corpus, "--padded-vocab-size", "300"], world_size=1)
    assert args_vocab_size(args) < 300 and model_vocab_size(args) == 300
    args.padded_vocab_size = args_vocab_size(args) - 1
    with pytest.raises(ValueError, match=r"--padded-vocab-size \d+ is smaller than the vocabulary"):
        model_vocab_size(args)
    args.padded_vocab_size, args.tensor_model_parallel_size = 301, 2
    with pytest.raises(ValueError, match="give a multiple of 2"):
        model_vocab_size(args)


def test_save_flags_without_save_warn_as_megatron_lm_trains(corpus):
    from megatron.training.arguments import parse_args

    args = parse_args([*TINY, "--data-path", corpus, "--save-interval", "5", "--no-save-optim"], world_size=1)
    assert args.compat_warnings == ["--save-interval without --save: no checkpoint is written (as in Megatron-LM)",
                                    "--no-save-optim without --save: no checkpoint is written (as in Megatron-LM)"]
