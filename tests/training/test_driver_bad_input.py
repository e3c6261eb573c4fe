"""Bad input: one clear error line on stderr, non-zero exit, no traceback, nothing written."""

import os
import subprocess

import pytest

from conftest import PRETRAIN, PY, ROOT, TINY, env

ISSUE_FLAGS = """--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --num-query-groups
--seq-length --max-position-embeddings --micro-batch-size --global-batch-size
--tensor-model-parallel-size --pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage
--lr --min-lr --lr-decay-style --lr-warmup-iters --weight-decay --clip-grad --train-iters
--eval-interval --eval-iters --log-interval --save --load --save-interval --data-path --split
--tokenizer-type --vocab-size --seed --bf16 --position-embedding-type --tensorboard-dir
--distributed-backend --cpu --distributed-timeout-minutes --exit-signal-handler
--sparse-attention --sb-block-size --sb-topk --sb-attention-backend --sb-dense-layers
--sb-batching""".split()


def run(args, world_size=None):
    e = env()
    if world_size:
        e["WORLD_SIZE"] = str(world_size)  # what torchrun would set; checks run before init
    return subprocess.run([PY, PRETRAIN, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)


def test_help_lists_every_flag():
    proc = run(["--help"])
    assert proc.returncode == 0
    missing = [f for f in ISSUE_FLAGS if f not in proc.stdout]
    assert not missing


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("corrupt")
    bad_idx = str(d / "bad_idx")
    open(bad_idx + ".bin", "wb").write(open(corpus + ".bin", "rb").read())
    open(bad_idx + ".idx", "wb").write(b"not an index at all")
    short_bin = str(d / "short_bin")
    open(short_bin + ".bin", "wb").write(open(corpus + ".bin", "rb").read()[:100])
    open(short_bin + ".idx", "wb").write(open(corpus + ".idx", "rb").read())
    empty_dir = str(d / "no_ckpt")
    os.makedirs(empty_dir)
    return {"bad_idx": bad_idx, "short_bin": short_bin, "no_ckpt": empty_dir}


CASES = {
    # name: (args builder, world size, text expected in the error line)
    "missing data": (lambda c, k: ["--data-path", "/nonexistent/corpus"], None, "does not exist"),
    "corrupt idx": (lambda c, k: ["--data-path", k["bad_idx"]], None, "not a valid indexed dataset"),
    "truncated bin": (lambda c, k: ["--data-path", k["short_bin"]], None, "bytes but the index"),
    "seq-length < 2": (lambda c, k: ["--data-path", c, "--seq-length", "1"], None, "--seq-length"),
    "gbs not divisible": (lambda c, k: ["--data-path", c, "--global-batch-size", "3"], 2, "not divisible"),
    "pp > layers": (lambda c, k: ["--data-path", c, "--pipeline-model-parallel-size", "8"], 8, "larger than --num-layers"),
    "rotary percent > 1": (lambda c, k: ["--data-path", c, "--rotary-percent", "1.5"], None, "--rotary-percent"),
    "odd rotary dims": (lambda c, k: ["--data-path", c, "--rotary-percent", "0.1875"], None, "even number"),
    "unknown flag": (lambda c, k: ["--data-path", c, "--no-such-flag", "3"], None, "--no-such-flag"),
    "abbreviated flag": (lambda c, k: ["--data-path", c, "--train-it", "3"], None, "--train-it"),
    "load without checkpoint": (lambda c, k: ["--data-path", c, "--load", k["no_ckpt"]], None, "no checkpoint"),
    "prompt mask without loss starts": (lambda c, k: ["--data-path", c, "--mask-prompt-loss"], None,
                                        "_loss_start.npy"),
    "cp not dividing world": (lambda c, k: ["--data-path", c, "--context-parallel-size", "2"], 3,
                              "not divisible by TP x PP x CP"),
    "cp with interleaved schedule": (lambda c, k: ["--data-path", c, "--context-parallel-size", "2",
                                                   "--pipeline-model-parallel-size", "2",
                                                   "--num-layers-per-virtual-pipeline-stage", "1"], 4,
                                     "--context-parallel-size > 1 with the interleaved schedule"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_one_line(name, corpus, corrupt, tmp_path):
    build, world, expect = CASES[name]
    save = tmp_path / "save"
    proc = run([*TINY, *build(corpus, corrupt), "--save", str(save)], world_size=world)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ") and expect in lines[0], lines[0]
    assert not save.exists() or not any(save.iterdir()), "something was written"


def test_tools_bad_input(tmp_path):
    for tool, args in (("preprocess_data.py", ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "o")]),
                       ("make_corpus.py", ["--output-prefix", str(tmp_path / "o"), "--lengths", "no_such_file"])):
        proc = subprocess.run([PY, os.path.join(ROOT, "tools", tool), *args], cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        assert not list(tmp_path.glob("o*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    proc = subprocess.run([PY, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(bad),
                           "--output-prefix", str(tmp_path / "o")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bad.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("o*")), "half-written dataset left behind"
