"""Bad input: one clear error line on stderr, non-zero exit, no traceback, nothing written;
Megatron-LM flags this driver refuses (one line with the reason); runs that fail safe
(non-finite loss, a --save in use, a changed schedule on resume, a full disk).

The one-line cases and the runs that train or fail safe fork from a warm process
(tests/_warm_runner.py: each a process of its own, with its exit status, stdout and
stderr); pretrain_gpt.py's cold start is checked in tests/integration/test_bad_input.py."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import PRETRAIN, PY, ROOT, TINY, env

from tests._warm_runner import WarmRunner

ISSUE_FLAGS = """--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --num-query-groups
--seq-length --max-position-embeddings --micro-batch-size --global-batch-size
--tensor-model-parallel-size --pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage
--lr --min-lr --lr-decay-style --lr-warmup-iters --weight-decay --clip-grad --train-iters
--eval-interval --eval-iters --log-interval --save --load --save-interval --data-path --split
--tokenizer-type --vocab-size --seed --bf16 --position-embedding-type --tensorboard-dir
--distributed-backend --cpu --distributed-timeout-minutes --exit-signal-handler
--sparse-attention --sb-block-size --sb-topk --sb-attention-backend --sb-dense-layers
--sb-batching""".split()


def run(args, world_size=None, warm=None):
    """pretrain_gpt.py with ``args``: a fresh interpreter, or forked from ``warm`` (a
    :class:`WarmRunner` with torch and megatron-core imported; the same exit, stdout, stderr)."""
    e = env()
    if world_size:
        e["WORLD_SIZE"] = str(world_size)  # what torchrun would set; checks run before init
    if warm is not None:
        return warm.run([PY, PRETRAIN, *args], ROOT, e)
    return subprocess.run([PY, PRETRAIN, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    runner = WarmRunner(str(tmp_path_factory.mktemp("warm_io")), env())
    yield runner
    runner.close()


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
    "pp > layers": (lambda c, k: ["--data-path", c, "--pipeline-model-parallel-size", "8"], 8,
                    "larger than --num-layers"),
    "rotary percent > 1": (lambda c, k: ["--data-path", c, "--rotary-percent", "1.5"], None, "--rotary-percent"),
    "odd rotary dims": (lambda c, k: ["--data-path", c, "--rotary-percent", "0.1875"], None, "even number"),
    "unknown flag": (lambda c, k: ["--data-path", c, "--no-such-flag", "3"], None, "--no-such-flag"),
    "abbreviated flag": (lambda c, k: ["--data-path", c, "--train-it", "3"], None, "--train-it"),
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
def test_bad_input_one_line(name, corpus, corrupt, tmp_path, warm):
    build, world, expect = CASES[name]
    save = tmp_path / "save"
    proc = run([*TINY, *build(corpus, corrupt), "--save", str(save)], world_size=world, warm=warm)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pretrain_gpt.py: error: ") and expect in lines[0], lines[0]
    assert not save.exists() or not any(save.iterdir()), "something was written"


def test_tools_bad_input(tmp_path):
    for tool, args in (("preprocess_data.py", ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                                               str(tmp_path / "o")]),
                       ("make_corpus.py", ["--output-prefix", str(tmp_path / "o"), "--lengths", "no_such_file"])):
        proc = subprocess.run([PY, os.path.join(ROOT, "tools", tool), *args], cwd=ROOT, env=env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        assert not list(tmp_path.glob("o*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    proc = subprocess.run([PY, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(bad),
                           "--output-prefix", str(tmp_path / "o")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bad.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("o*")), "half-written dataset left behind"


# ---- Megatron-LM flags this driver refuses, and Megatron-LM's rules (issue 33) -----------------
# In-process (argument parsing only, milliseconds): name -> (extra flags, world size, text the
# single error line must contain). Each states the behaviour: one line naming the flag and why.
PARSE_CASES = {
    "moe family refused with the reason": (["--num-experts", "8"], None, "--num-experts: mixture of experts"),
    "mla option refused with the reason": (["--multi-latent-attention", "--cache-mla-latents"], None,
                                           "--cache-mla-latents: this multi-latent attention option is not "
                                           "implemented"),
    "fp8 needs transformer engine on a gpu": (["--fp8-format", "hybrid"], None,
                                              "--fp8-format: needs Transformer Engine"),
    "tp comm overlap needs sequence parallelism": (["--tp-comm-overlap"], None,
                                                   "--tp-comm-overlap needs --sequence-parallel"),
    "bf16 on cpu names cuda": (["--bf16", "--cpu"], None, "--bf16 needs CUDA"),
    "fp16 on cpu names cuda": (["--fp16", "--cpu"], None, "--fp16 needs CUDA"),
    "nccl on cpu names cuda": (["--distributed-backend", "nccl", "--cpu"], None, "nccl needs CUDA"),
    "dropout above one refused": (["--hidden-dropout", "1.5"], None,
                                  "--hidden-dropout 1.5: a dropout probability is at most 1"),
    "attention dropout with sparse attention refused": (["--sparse-attention", "--attention-dropout", "0.1"], None,
                                                        "the sparse attention kernels apply no dropout"),
    "ckpt format other than torch_dist or torch refused": (["--ckpt-format", "torch_dcp"], None,
                                                           "--ckpt-format torch_dcp"),
    "fsdp checkpoint format names fsdp": (["--ckpt-format", "fsdp_dtensor"], None,
                                          "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM "
                                          "asserts the same)"),
    "legacy models refused": (["--use-legacy-models"], None, "only megatron-core models"),
    "train iters and samples exclusive": (["--train-iters", "4", "--train-samples", "8"], None,
                                          "--train-iters or --train-samples, not both"),
    "iters decay flag with samples refused": (["--train-samples", "8", "--lr-decay-iters", "2"], None,
                                              "--lr-decay-iters goes with --train-iters"),
    "samples warmup with iters refused": (["--lr-warmup-samples", "4"], None,
                                          "--lr-warmup-samples goes with --train-samples"),
    "warmup fraction and iters exclusive": (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], None,
                                            "--lr-warmup-fraction or --lr-warmup-iters"),
    "both scheduler resume flags refused": (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
                                            None, "not both"),
    "wsd needs its decay length": (["--lr-decay-style", "WSD"], None, "--lr-wsd-decay-iters"),
    "recompute activations conflicts with full": (["--recompute-activations", "--recompute-granularity", "full"], None,
                                                  "--recompute-activations means --recompute-granularity selective"),
    "gpt2 bpe needs vocab and merges": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], None,
                                        "needs --vocab-file (vocab.json) and --merge-file"),
    "tokenizer model never ignored": (["--tokenizer-model", "tok.json"], None,
                                      "--tokenizer-model is not read by --tokenizer-type ByteTokenizer"),
    "merge file never ignored": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "t",
                                  "--merge-file", "m.txt"], None, "--merge-file is not read"),
    "llama2 tokenizer needs a model file": (["--tokenizer-type", "Llama2Tokenizer"], None, "needs --tokenizer-model"),
    "mock data and data path exclusive": (["--mock-data"], None, "--data-path or --mock-data, not both"),
    "not a megatron-lm flag stays unrecognized": (["--no-such-megatron-flag"], None,
                                                  "unrecognized arguments: --no-such-megatron-flag"),
    # issue 42: flags of Megatron-LM main and dev, and of its forks
    "schedule with global batch size refused": (["--step-batch-size-schedule", "0:4"], None,
                                                "--step-batch-size-schedule or --global-batch-size, not both"),
    "null tokenizer pad id needs null tokenizer": (["--null-tokenizer-pad-id", "0"], None,
                                                   "--null-tokenizer-pad-id is read by --tokenizer-type "
                                                   "NullTokenizer only"),
    "dev dynamic cp names the sparsebalance+dcp arm": (["--dynamic-context-parallel"], None,
                                                       "--dynamic-context-parallel: dynamic (hybrid) context "
                                                       "parallelism is not in this driver"),
    "main hybrid cp names the sparsebalance+dcp arm": (["--hybrid-context-parallel"], None, "sparsebalance+dcp"),
    "mindspeed flag names the fork": (["--use-fused-rmsnorm"], None,
                                      "--use-fused-rmsnorm: a MindSpeed flag, not Megatron-LM's"),
    "mindspeed-llm flag names what to use": (["--tokenizer-name-or-path", "qwen"], None,
                                             "a MindSpeed-LLM flag, not Megatron-LM's: this driver does not "
                                             "implement it; use --tokenizer-type HuggingFaceTokenizer"),
    "mindspeed cp algorithm names context-parallel-size": (["--context-parallel-algo", "ulysses_cp_algo"], None,
                                                           "use --context-parallel-size"),
    "flagscale flag names the fork": (["--hetero-process-meshes", "1", "1", "1", "1", "1"], None,
                                      "--hetero-process-meshes: a FlagScale flag"),
    "pai flag names the fork": (["--patch-tokenizer-type", "Qwen2Tokenizer"], None,
                                "--patch-tokenizer-type: a Pai-Megatron-Patch flag"),
    "main architecture flag says what exists": (["--qk-l2-norm"], None,
                                                "--qk-l2-norm: architecture option not implemented"),
    "squared relu excludes swiglu": (["--squared-relu", "--swiglu"], None,
                                     "give --squared-relu or --swiglu, not both"),
    "evaluation batch splits over DP": (["--eval-global-batch-size", "3"], 2,
                                        "--eval-global-batch-size 3 is not divisible by micro-batch size x DP = 1 x 2"),
    "uneven stages need a pipeline": (["--decoder-first-pipeline-num-layers", "1"], None,
                                      "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size >= 2"),
    "uneven stages split the rest evenly": (["--pipeline-model-parallel-size", "3",
                                             "--decoder-last-pipeline-num-layers", "1"], 3,
                                            "--decoder-last-pipeline-num-layers: num_layers (4) less the "
                                            "first/last stage's ([1]) is not divisible by the other 2 stage(s)"),
    "retained checkpoints fall on saves": (["--save", "ckpt", "--save-interval", "2", "--save-retain-interval", "3"],
                                           None, "--save-retain-interval 3 is not a multiple of --save-interval 2"),
    "main offload flag says what to use": (["--activation-offload-fraction", "0.5"], None,
                                           "use --recompute-granularity"),
}


def _parse_error(argv, world, capsys):
    from megatron.training.arguments import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv, world_size=world)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("pretrain_gpt.py: error: "), lines
    return lines[0]


@pytest.mark.parametrize("name", list(PARSE_CASES))
def test_megatron_lm_flag_refused_in_one_line(name, corpus, capsys):
    extra, world, expect = PARSE_CASES[name]
    line = _parse_error([*TINY, "--data-path", corpus, *extra], world, capsys)
    assert expect in line, line


NO_GBS = [a for i, a in enumerate(TINY) if "--global-batch-size" not in TINY[max(i - 1, 0):i + 1]]


SCHEDULES = {"0:4 256:8": "a batch that changes during the run is not supported",  # 1 sample: iteration 2
             "1K:4": "the first entry must start at 0", "0:four": "'0:four' is not THRESHOLD:BATCH",
             "0-4": "'0-4' is not THRESHOLD:BATCH"}


def test_changing_batch_size_schedule_refused_in_one_line(corpus, capsys):
    """Megatron-LM main's --step-batch-size-schedule: a schedule that changes the global batch
    (or a malformed one) is one error line; a constant one is --global-batch-size."""
    assert "--global-batch-size" not in NO_GBS
    for schedule, expect in SCHEDULES.items():
        line = _parse_error([*NO_GBS, "--data-path", corpus, "--step-batch-size-schedule", schedule], None, capsys)
        assert expect in line, line


def test_flags_of_megatron_lm_main_are_honoured(corpus):
    """Flags Megatron-LM main has and this driver implements or documents as no-ops (the
    issue's three included) parse, with their effect on the run's settings."""
    from megatron.training.arguments import parse_args

    args = parse_args([*NO_GBS, "--data-path", corpus, "--step-batch-size-schedule", "0:8 1B:8",
                       "--original-max-position-embeddings", "4096", "--no-pad-vocab-size",
                       "--start-eval-at-iter", "3", "--verify-integrity", "--eval-micro-batch-size", "1",
                       "--null-tokenizer-eod-id", "7", "--eval-global-batch-size", "16", "--deterministic-mode",
                       "--inference-max-seq-length", "256", "--max-tokens-to-oom", "100"], world_size=2)
    assert args.global_batch_size == 8 and args.num_microbatches == 4 and args.eval_num_microbatches == 8
    assert args.make_vocab_size_divisible_by == 1 and args.start_eval_at_iter == 3
    # under a schedule Megatron-LM counts --lr-*-iters in micro-batch x DP samples: the one warning
    assert [w.split(":")[0] for w in args.compat_warnings] == ["--step-batch-size-schedule with --train-iters"]
    from megatron.training import compat

    # --deterministic-mode: the CPU path is deterministic already; on CUDA the sparse kernels are not
    compat.check_hardware(args, cuda=False)
    compat.check_hardware(args, cuda=True)
    args.sparse_attention = True
    with pytest.raises(ValueError, match="--deterministic-mode on CUDA with --sparse-attention"):
        compat.check_hardware(args, cuda=True)
    pad = parse_args([*TINY, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                      "--null-tokenizer-pad-id", "99"], world_size=1)
    assert pad.null_tokenizer_pad_id == 99


@pytest.mark.parametrize("data, expect", [
    ("0.5 {c} {c}", "a blend is WEIGHT PREFIX pairs"),
    ("0.5 {c} x {c}", "'x' is not a weight"),
    ("0.5 {c} 0.5 /nonexistent/b", "/nonexistent/b.bin does not exist"),
    ("{c} 0.5", "looks like a weight"),
])
def test_bad_blended_data_path_one_line(data, expect, corpus, capsys):
    """``--data-path "0.5 A 0.5 B"`` is Megatron-LM's blend; a malformed one names the word."""
    line = _parse_error([*TINY, "--data-path", *data.format(c=corpus).split()], None, capsys)
    assert expect in line, line


def _check_inputs_error(argv, capsys, monkeypatch):
    """pretrain_gpt.py's input checks (tokenizer files, data, --load, --save lock), in-process."""
    import importlib.util

    from megatron.training.arguments import parse_args

    monkeypatch.setenv("RANK", "0")
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", PRETRAIN)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    args = parse_args(argv, world_size=1)
    with pytest.raises(SystemExit) as e:
        driver._check_inputs(args)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_hf_tokenizer_name_is_not_downloaded(corpus, capsys, monkeypatch):
    """A hub model name (not a local path) is refused in one line; nothing is downloaded."""
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--tokenizer-type", "HuggingFaceTokenizer",
                                "--tokenizer-model", "Qwen/Qwen2.5-0.5B"], capsys, monkeypatch)
    assert "Qwen/Qwen2.5-0.5B: not a local file or directory" in line and "download" in line, line


def test_hf_tokenizer_dir_without_tokenizer_json(corpus, tmp_path, capsys, monkeypatch):
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--tokenizer-type", "HuggingFaceTokenizer",
                                "--tokenizer-model", str(tmp_path)], capsys, monkeypatch)
    assert "has no tokenizer.json" in line and "Llama2Tokenizer" in line, line


def test_corrupt_tokenizer_json_names_the_file(corpus, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ not a tokenizer")
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--tokenizer-type", "HuggingFaceTokenizer",
                                "--tokenizer-model", str(bad)], capsys, monkeypatch)
    assert f"{bad}: not a Hugging Face tokenizer.json" in line, line


def test_sentencepiece_model_without_the_package(corpus, tmp_path, capsys, monkeypatch):
    """Llama2Tokenizer reads tokenizer.model with the sentencepiece package; without it, one
    line names the package (here it is installed: its import is made to fail)."""
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # `import sentencepiece` raises ImportError
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x00")
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--tokenizer-type", "Llama2Tokenizer",
                                "--tokenizer-model", str(tmp_path)], capsys, monkeypatch)
    assert "needs the sentencepiece package" in line and "tokenizer.model" in line, line


def test_non_utf8_profile_names_the_file(corpus, tmp_path, capsys, monkeypatch):
    prof = tmp_path / "profile.json"
    prof.write_bytes(b'{"format": "caf\xe9"}')
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--sparse-balance", "--sb-profile", str(prof)],
                               capsys, monkeypatch)
    assert str(prof) in line and "UTF-8" in line, line


def test_exit_on_missing_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    """--load without a checkpoint starts fresh, unless --exit-on-missing-checkpoint."""
    d = str(tmp_path / "ck")
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--save", d, "--load", d,
                                "--exit-on-missing-checkpoint"], capsys, monkeypatch)
    assert "no checkpoint in" in line, line


def test_finetune_without_a_checkpoint_trains_from_scratch_with_one_warning(corpus, tmp_path, capsys, monkeypatch):
    """As in Megatron-LM (no tracker: random weights), --finetune with an empty --load is no error."""
    import importlib.util

    from megatron.training.arguments import parse_args

    monkeypatch.setenv("RANK", "0")
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", PRETRAIN)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    driver._check_inputs(parse_args([*TINY, "--data-path", corpus, "--load", str(empty), "--finetune"], world_size=1))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "training starts from scratch (--finetune has no weights to take)" in lines[0], lines


def test_save_dir_in_use_by_a_live_run_is_refused(corpus, tmp_path, capsys, monkeypatch):
    """A --save directory whose lock names a live process is refused in one line."""
    from megatron.training.failsafe import LOCK_NAME, SaveDirLock

    save = tmp_path / "ck"
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock = SaveDirLock(str(save))
        monkeypatch.setattr(os, "getpid", lambda: holder.pid)  # write the lock as that process
        lock.acquire()
        monkeypatch.undo()
        assert (save / LOCK_NAME).exists()
        line = _check_inputs_error([*TINY, "--data-path", corpus, "--save", str(save)], capsys, monkeypatch)
        assert f"--save {save} is in use by a running pretrain_gpt.py (pid {holder.pid}" in line, line
    finally:
        holder.kill()
        holder.wait()


def test_save_without_room_for_a_checkpoint_is_refused_before_step_1(corpus, tmp_path, capsys, monkeypatch):
    """--save on a file system with less free space than one checkpoint of the model (weights
    and Adam state, a lower bound) is one line naming the path and both sizes, before any
    process group or training; the directory the check created is removed again."""
    from megatron.training.preflight import checkpoint_bytes

    class Tiny:  # 64 KB free of 4 GB
        f_bavail, f_frsize, f_blocks = 16, 4096, 1 << 20

    save = tmp_path / "new" / "ck"
    monkeypatch.setattr(os, "statvfs", lambda p: Tiny())
    line = _check_inputs_error([*TINY, "--data-path", corpus, "--save", str(save)], capsys, monkeypatch)
    assert f"--save {save}: 64.0 KB free on its file system; a checkpoint of this model needs at least" in line
    assert not (tmp_path / "new").exists(), "the check left a directory behind"
    from megatron.training.arguments import parse_args

    args = parse_args([*TINY, "--data-path", corpus], world_size=1)
    need = checkpoint_bytes(args, 256)
    assert 64 * 1024 < need < 20 * 2 ** 20  # the tiny model's weights + Adam moments (~1 M parameters)
    args.no_save_optim = True
    assert checkpoint_bytes(args, 256) * 3 == need  # weights alone: 4 of the 12 bytes a parameter


def test_lock_of_a_killed_run_does_not_block(tmp_path):
    """A lock whose process is dead on this host is stale: the next run takes it over."""
    from megatron.training.failsafe import LOCK_NAME, SaveDirLock

    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(f'{{"pid": {dead.pid}, "host": "{os.uname().nodename}", '
                                      '"started": "1", "since": "then"}\n')
    lock = SaveDirLock(str(tmp_path))
    lock.acquire()
    assert lock.held and f'"pid": {os.getpid()}' in (tmp_path / LOCK_NAME).read_text()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


# ---- fail-safe runs (real runs, a few seconds each) ---------------------------------------------
RUN = [*TINY, "--cpu", "--num-layers", "2", "--global-batch-size", "2", "--seq-length", "128"]


def _one_error_line(proc):
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("pretrain_gpt.py: error:")]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_nonfinite_loss_stops_before_any_checkpoint(tmp_path, warm):
    """--lr 1e6 (on --mock-data, --save-interval 1): the run stops at the first non-finite
    iteration with one line naming it (exit 1); the checkpoints of the finite iterations
    before it are kept and none of it or later is written (Megatron-LM's
    --check-for-nan-in-loss-and-grad, on by default)."""
    save = tmp_path / "ck"
    proc = run([*RUN, "--mock-data", "--lr", "1e6", "--train-iters", "4", "--save", str(save),
                "--save-interval", "1"], warm=warm)
    line = _one_error_line(proc)
    bad = int(re.search(r"iteration (\d+): non-finite loss", line).group(1))
    saved = sorted(int(p.name[5:]) for p in save.glob("iter_*"))
    assert bad >= 2 and saved == list(range(1, bad)), (line, saved)  # every finite step, none after


def test_nonfinite_run_without_check_writes_strict_json_and_no_checkpoint(corpus, tmp_path, warm):
    """--no-check-for-nan-in-loss-and-grad trains on: the summary JSON is strict JSON
    (non-finite numbers are null), and the final save refuses non-finite weights (exit 1)."""
    out, save = tmp_path / "summary.json", tmp_path / "ck"
    proc = run([*RUN, "--data-path", corpus, "--lr", "1e6", "--train-iters", "3", "--summary-json", str(out),
                "--no-check-for-nan-in-loss-and-grad"], warm=warm)
    assert proc.returncode == 0, proc.stderr[-2000:]

    def no_constants(name):
        raise AssertionError(f"bare {name} in the summary JSON")

    summary = json.loads(out.read_text(), parse_constant=no_constants)
    assert None in summary["losses"], summary["losses"]
    proc = run([*RUN, "--data-path", corpus, "--lr", "1e6", "--train-iters", "3", "--save", str(save),
                "--no-check-for-nan-in-loss-and-grad"], warm=warm)
    line = _one_error_line(proc)
    assert "holds non-finite values" in line and not list(save.glob("iter_*")), line


def test_resume_with_changed_train_iters_follows_megatron_lm_rule(corpus, tmp_path, warm):
    """A resume whose LR schedule differs from the checkpoint's (--train-iters changed) stops
    with one line naming both rule flags; --use-checkpoint-opt_param-scheduler keeps the
    checkpoint's schedule and says so (--override-opt_param-scheduler, the new one, is what
    test_resume.py and test_checkpoint_integrity.py resume with)."""
    save = str(tmp_path / "ck")
    base = [*RUN, "--data-path", corpus, "--save", save, "--load", save, "--lr-decay-style", "linear"]
    assert run([*base, "--train-iters", "2"], warm=warm).returncode == 0
    line = _one_error_line(run([*base, "--train-iters", "4"], warm=warm))
    assert "the LR schedule differs from the checkpoint's" in line and "--override-opt_param-scheduler" in line
    keep = run([*base, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler"], warm=warm)
    assert keep.returncode == 0, keep.stderr[-2000:]
    assert "LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler" in keep.stdout
    lr = [float(m) for m in re.findall(r"\| lr ([0-9.e+-]+) \|", keep.stdout)]
    assert lr and lr[-1] == 0.0, lr  # the checkpoint's decay ended at iteration 2: lr 0 from then on


def test_disk_full_save_dir_refused_before_training(corpus, tmp_path, warm):
    """--save on a 256 KB tmpfs (less than one checkpoint of the model) is refused before step
    1 with one line naming the path and the space (it used to fail at the first save)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        proc = run([*RUN, "--data-path", corpus, "--train-iters", "1", "--save", str(mnt / "ck")], warm=warm)
        assert "Traceback" not in proc.stderr and proc.returncode == 2, proc.stderr[-3000:]
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and f"--save {mnt / 'ck'}: " in lines[0] and "free on its file system" in lines[0]
        assert "ENOSPC" in lines[0] and "iter" not in proc.stdout, lines
        assert not (mnt / "ck").exists(), "the check left a directory behind"
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_load_without_checkpoint_warns_and_starts_from_scratch(corpus, tmp_path, warm):
    """--load of a directory with no checkpoint (launch scripts pass --save X --load X on the
    first run; here --load differs from --save): one warning line naming it, then training from
    iteration 1, as Megatron-LM does. --start-eval-at-iter 2 (Megatron-LM main) with
    --eval-interval 1: validation runs at iteration 2 only."""
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run([*RUN, "--data-path", corpus, "--train-iters", "2", "--load", str(empty), "--save",
                str(tmp_path / "ck"), "--eval-interval", "1", "--start-eval-at-iter", "2", "--eval-iters", "1"],
               warm=warm)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warned = [ln for ln in proc.stderr.splitlines() if ln.startswith("pretrain_gpt.py: warning:")]
    assert warned == [f"pretrain_gpt.py: warning: --load {empty}: no checkpoint there; training starts from "
                      "scratch (as in Megatron-LM; --exit-on-missing-checkpoint makes this an error)"], warned
    assert re.search(r"iter +1/2", proc.stdout) and (tmp_path / "ck" / "iter_0000002").is_dir()
    assert re.findall(r"iter +(\d+) \| validation loss", proc.stdout) == ["2"], proc.stdout[-2000:]


def test_resume_with_other_sparse_settings_logs_each_change(corpus, tmp_path, warm):
    """A resume whose sparse-attention settings differ from the checkpoint's (block 16 -> 8,
    top-k 2 -> 4) trains, with one warning line per changed setting (the DST bounds follow
    top-k); an unchanged resume prints none."""
    save = str(tmp_path / "ck")
    base = [*RUN, "--data-path", corpus, "--save", save, "--load", save, "--sparse-attention",
            "--override-opt_param-scheduler"]
    first = run([*base, "--train-iters", "1", "--sb-block-size", "16", "--sb-topk", "2"], warm=warm)
    assert first.returncode == 0, first.stderr[-2000:]
    same = run([*base, "--train-iters", "2", "--sb-block-size", "16", "--sb-topk", "2"], warm=warm)
    assert same.returncode == 0 and "resuming with" not in same.stderr, same.stderr[-2000:]
    other = run([*base, "--train-iters", "3", "--sb-block-size", "8", "--sb-topk", "4"], warm=warm)
    assert other.returncode == 0, other.stderr[-2000:]
    lines = [ln for ln in other.stderr.splitlines() if "resuming with" in ln]
    assert lines == ["pretrain_gpt.py: warning: resuming with --sb-block-size 8 (the checkpoint's: 16)",
                     "pretrain_gpt.py: warning: resuming with --sb-topk 4 (the checkpoint's: 2)",
                     "pretrain_gpt.py: warning: resuming with --sb-topk-min 2 (the checkpoint's: 1)",
                     "pretrain_gpt.py: warning: resuming with --sb-topk-max 8 (the checkpoint's: 4)"], lines
    assert re.search(r"iter +3/3", other.stdout)


def test_eval_interval_with_empty_validation_split_warns_once(corpus, capsys, monkeypatch):
    """--eval-interval with a --split that leaves no validation document: one warning line
    (no evaluation can run), not silence."""
    import importlib.util

    from megatron.training.arguments import parse_args

    monkeypatch.setenv("RANK", "0")
    spec = importlib.util.spec_from_file_location("pretrain_gpt_under_test", PRETRAIN)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    driver._check_inputs(parse_args([*TINY, "--data-path", corpus, "--split", "100,0,0", "--eval-interval", "2"],
                                    world_size=1))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: warning: --eval-interval 2:"), lines
    assert "no evaluation will run" in lines[0]


def test_exit_interval_stops_and_saves(corpus, tmp_path, warm):
    """Megatron-LM's --exit-interval: stop after the first iteration divisible by it, saving."""
    save = tmp_path / "ck"
    proc = run([*RUN, "--data-path", corpus, "--train-iters", "6", "--exit-interval", "2", "--save", str(save)],
               warm=warm)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stopping after iteration 2 (--exit-interval 2)" in proc.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_save_step_names_enospc_whatever_the_writer_said(tmp_path, monkeypatch):
    """torch.save's zip writer on a full disk says "unexpected pos ..." (the errno is lost):
    the save step still names ENOSPC and the path; other failures keep their own words."""
    import errno as E

    from megatron.training import checkpointing as ckpt

    def zip_writer_on_full_disk():
        try:
            raise OSError(E.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")

    msg = ckpt._step(zip_writer_on_full_disk, str(tmp_path))
    assert msg.startswith("unexpected pos 704 vs 598") and f"ENOSPC: no space left on device writing {tmp_path}" in msg
    assert ckpt._step(lambda: (_ for _ in ()).throw(RuntimeError("bad shape")), str(tmp_path)) == "bad shape"

    class Full:  # the file system reports no free blocks, the error says nothing about it
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    msg = ckpt._step(lambda: (_ for _ in ()).throw(RuntimeError("unexpected pos 1 vs 0")), str(tmp_path))
    assert "ENOSPC" in msg and str(tmp_path) in msg
