"""Bad-input sweep: pretrain_gpt.py, every tool in tools/, ``python -m
sparsebalance.batching`` and the long-context recipe's curriculum.py on bad arguments
and files (a latency profile that is stale, malformed or missing included).

The contract (project standard for CLIs): a non-zero exit, exactly one line on stderr
that names the problem, no traceback anywhere, and no output file left behind.

All cases run once per module (a fixture), two at a time; each case is then checked in its
own parametrized test so a failure names the tool and the input. Each script has one cold
case, a fresh interpreter (its import-time output counts); the others fork from a warm
process that has imported torch and megatron-core once (``tests/_warm_runner.py``: the case's
own cwd, environment, argv, stdout, stderr and exit status; ~0.5 s a case instead of ~6).
``test_warm_runner_behaves_like_python`` holds the warm runner to a fresh interpreter.
``test_every_tool_has_cases`` fails when a tool in tools/ has no row here, or a script no
cold case.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest

from tests._warm_runner import WarmRunner

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TIMEOUT_S = 120


@dataclass
class Case:
    """One bad invocation and what its single error line must mention."""

    id: str
    script: str  # path relative to the repo root, or "-m package" (run as a module)
    argv: Callable[[str], list[str]]  # tmp dir -> arguments
    mention: str  # regex the error line must match (case-insensitive)
    no_outputs: Callable[[str], list[str]] = field(default=lambda d: [])  # paths that must not exist
    cold: bool = False  # run in a fresh interpreter (each script has one); else forked warm


def _p(*parts):
    return lambda d: [a.format(d=d) for a in parts]


# Files every case can use ({d} = the module's temporary directory).
def make_bad_files(d: str) -> None:
    sys.path.insert(0, REPO)
    from megatron.training.indexed_io import write_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 200, size=n) for n in (40, 70, 25, 90, 60, 33)]
    write_documents(f"{d}/good", docs, 256)
    idx = open(f"{d}/good.idx", "rb").read()
    binary = open(f"{d}/good.bin", "rb").read()
    for name, b, i in (("trunc_idx", binary, idx[: len(idx) // 2]),
                       ("short_bin", binary[: len(binary) // 2], idx),
                       ("garbage_idx", binary, b"not an index at all" * 4)):
        open(f"{d}/{name}.bin", "wb").write(b)
        open(f"{d}/{name}.idx", "wb").write(i)
    open(f"{d}/only.idx", "wb").write(idx)  # .bin missing
    open(f"{d}/empty.jsonl", "w").close()
    open(f"{d}/blank.jsonl", "w").write("\n\n  \n")
    open(f"{d}/latin1.jsonl", "wb").write(b'{"text": "caf\xe9 cr\xe8me"}\n')
    open(f"{d}/notjson.jsonl", "w").write('{"text": "fine"}\n{"text": unquoted}\n')
    open(f"{d}/nokey.jsonl", "w").write('{"body": "no text field"}\n')
    open(f"{d}/notstr.jsonl", "w").write('{"text": 42}\n')
    open(f"{d}/empty.json", "w").close()
    open(f"{d}/garbage.json", "w").write("{ this is not json")
    json.dump({"unrelated": True}, open(f"{d}/wrong_schema.json", "w"))
    stage = {"name": "s1", "lr": 1e-3, "budget_s": 60, "seq_length": 512, "global_batch": 2,
             "mixes": [{"tasks": "recite", "lengths": "256,1024", "docs": 10, "seed": 1}]}
    json.dump({"stages": [stage]}, open(f"{d}/stages_too_long.json", "w"))
    json.dump({"stages": [dict(stage, seq_length=1024, warmup=5)]}, open(f"{d}/stages_unknown_key.json", "w"))
    json.dump({"stages": [dict(stage, seq_length=1024)]}, open(f"{d}/stages_ok.json", "w"))
    # A latency profile of another model (48 layers, block 128) than the one asked for.
    from sparsebalance.predictor import profile as prof

    other = {"format": prof.FORMAT, "version": prof.VERSION, "created": "2026-01-01T00:00:00Z",
             "command": "tools/profile_latency.py", "hardware": prof.hardware_fingerprint(),
             "model": {"num_layers": 48, "hidden_size": 4096, "num_attention_heads": 32,
                       "block_size": 128, "topk": 16},
             "timing": {}, "samples": []}
    json.dump(other, open(f"{d}/other_model_profile.json", "w"))
    # A real profile of the model the cases ask for (TINY + SB_TINY), made at another thread
    # count than theirs (OMP_NUM_THREADS=1): the only difference is hardware.threads.
    made = subprocess.run([PY, os.path.join(REPO, "tools", "profile_latency.py"), "--quick", "--cpu",
                           "--output", f"{d}/threads_profile.json", "--sparse-attention",
                           *TINY_MODEL, *SB_TINY, "--repeats", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=d,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL)
    assert made.returncode == 0, made.stderr[-2000:]
    real = json.load(open(f"{d}/threads_profile.json"))
    assert real["hardware"]["threads"] == 1, real["hardware"]
    real["hardware"]["threads"] = 2
    json.dump(real, open(f"{d}/threads_profile.json", "w"))
    text = open(f"{d}/threads_profile.json").read()
    open(f"{d}/truncated_profile.json", "w").write(text[: len(text) // 2])
    json.dump(dict(real, hardware=[], samples="x"), open(f"{d}/bad_types_profile.json", "w"))
    json.dump([int(x) for x in rng.integers(100, 3000, size=80)], open(f"{d}/lengths.json", "w"))
    os.makedirs(f"{d}/a_dir", exist_ok=True)
    os.makedirs(f"{d}/empty_ckpt", exist_ok=True)
    os.makedirs(f"{d}/flags_only", exist_ok=True)  # passes a --load check that looks for model_flags.txt
    open(f"{d}/flags_only/model_flags.txt", "w").write("--num-layers 2\n")
    json.dump({"format": "sb-stage-sensitivity", "version": 1, "num_layers": 2,  # 3 values for 2 stages
               "profiles": [{"stages": 2, "nats_per_pair": [1.0, 2.0, 3.0]}]}, open(f"{d}/stage_bad.json", "w"))
    os.makedirs(f"{d}/a_dir_with_file", exist_ok=True)
    open(f"{d}/a_dir_with_file/x", "w").close()
    _make_hf_dirs(d)
    _make_bad_checkpoints(d)


def _make_bad_checkpoints(d: str) -> None:
    """--load directories whose every checkpoint fails its manifest check (made-up files:
    the check runs before anything is read as a checkpoint)."""
    from megatron.training.checkpointing import TRACKER, iter_dir, write_manifest

    def make(root, iteration, manifest=True):
        path = iter_dir(root, iteration)
        os.makedirs(path)
        open(f"{path}/__0_0.distcp", "wb").write(bytes(range(200)))
        if manifest:
            write_manifest(path, iteration, {"__0_0.distcp": {"size": 200, "sha256": hashlib.sha256(
                bytes(range(200))).hexdigest()}})
        open(f"{root}/{TRACKER}", "w").write(f"{iteration}\n")
        return f"{path}/__0_0.distcp"

    os.truncate(make(f"{d}/ck_truncated", 1), 100)
    flipped = make(f"{d}/ck_all_damaged", 1)
    open(flipped, "r+b").write(b"\xff")  # same size, another checksum
    make(f"{d}/ck_all_damaged", 2, manifest=False)  # an interrupted save
    make(f"{d}/ck_bad_manifest", 1)
    open(f"{iter_dir(f'{d}/ck_bad_manifest', 1)}/manifest.json", "w").write("{ not json")


def _make_hf_dirs(d: str) -> None:
    """Tiny Hugging Face directories with one defect each, for tools/checkpoint/convert.py."""
    sys.path.insert(0, os.path.join(REPO, "tests", "checkpoint"))
    from _hf_models import write_plain_hf

    write_plain_hf(f"{d}/hf_good")
    write_plain_hf(f"{d}/hf_mistral", architectures=["MistralForCausalLM"])
    write_plain_hf(f"{d}/hf_missing", drop=("model.layers.0.mlp.up_proj.weight",))
    write_plain_hf(f"{d}/hf_shard_lacks", drop=("model.layers.0.self_attn.k_proj.weight",), indexed=True)
    write_plain_hf(f"{d}/hf_type_mismatch", model_type="mistral")  # architectures: Qwen2ForCausalLM
    write_plain_hf(f"{d}/hf_shape", tensors_of={"intermediate_size": 20})
    write_plain_hf(f"{d}/hf_vocab", tokens=40)
    os.makedirs(f"{d}/hf_noweights", exist_ok=True)
    shutil.copy(f"{d}/hf_good/config.json", f"{d}/hf_noweights/config.json")


TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "64"]
# this driver's defaults before Megatron-LM's, so that each case's one line is its own error's
TINY = ["--cpu", *TINY_MODEL, "--train-iters", "1", "--tokenizer-type", "ByteTokenizer", "--transformer-impl",
        "local", "--split", "98,2,0", "--hidden-dropout", "0", "--attention-dropout", "0"]
SB_TINY = ["--sb-block-size", "32", "--sb-topk", "2"]


def _pretrain(*extra):
    return lambda d: TINY + ["--data-path", f"{d}/good"] + [a.format(d=d) for a in extra]


def _pretrain_sb(profile):
    return _pretrain("--sparse-balance", *SB_TINY, "--sb-profile", profile)


def _sim_profile(profile, out):
    return _p("from-lengths", "--lengths", "{d}/lengths.json", "--predictor", profile, "--num-layers", "2",
              "--block-size", "32", "--seq-length", "8192", "--pp", "2", "--dp", "1", "--microbatches", "2",
              "--out", out)


def _pack(profile, *model):
    """``python -m sparsebalance.batching pack`` on the sweep's tiny model (or ``model``)."""
    shape = dict(model) or {"hidden_size": 32, "num_attention_heads": 2}
    return _p("pack", "--lengths", "{d}/lengths.json", "--dp", "1", "--micro-batches", "2",
              "--seq-length", "8192", "--pp", "2", "--steps", "1", "--block-size", "32", "--topk", "2",
              "--cost-model", profile, "--model-config", json.dumps(shape).replace("{", "{{").replace("}", "}}"))


def _compare_sim(profile, n):
    """``benchmarks/compare.py --mode sim`` with ``profile`` as the cost model of the tiny model."""
    return _p("--mode", "sim", "--cost-model", profile, "--sim-models", "profile", "--lengths",
              "{d}/lengths.json", "--seq-lengths", "8192", "--pp", "2", "--dp", "1",
              "--micro-batches", "2", "--block-size", "32", "--topk", "2", "--sim-steps", "1",
              "--report", f"{{d}}/cmp{n}")


STALE_THREADS = r"threads_profile\.json does not match.*hardware\.threads: profile 2, now 1"


CASES = [
    # pretrain_gpt.py: bad sizes, bad data, bad checkpoints
    Case("pretrain-negative-layers", "pretrain_gpt.py", _pretrain("--num-layers", "-2"), r"num-layers"),
    Case("pretrain-zero-hidden", "pretrain_gpt.py", _pretrain("--hidden-size", "0"), r"hidden-size"),
    Case("pretrain-negative-seq", "pretrain_gpt.py", _pretrain("--seq-length", "-8"), r"seq-length"),
    Case("pretrain-negative-lr", "pretrain_gpt.py", _pretrain("--lr", "-1"), r"--lr"),
    Case("pretrain-pp-vs-world", "pretrain_gpt.py", _pretrain("--pipeline-model-parallel-size", "2"),
         r"world size|pipeline"),
    Case("pretrain-unknown-flag", "pretrain_gpt.py", _pretrain("--no-such-flag"), r"no-such-flag"),
    Case("pretrain-missing-data", "pretrain_gpt.py",
         lambda d: TINY + ["--data-path", f"{d}/nothing"], r"nothing\.(bin|idx)"),
    Case("pretrain-missing-bin", "pretrain_gpt.py",
         lambda d: TINY + ["--data-path", f"{d}/only"], r"only\.bin"),
    Case("pretrain-truncated-idx", "pretrain_gpt.py",
         lambda d: TINY + ["--data-path", f"{d}/trunc_idx", "--save", f"{d}/ck_trunc"],
         r"trunc_idx", lambda d: [f"{d}/ck_trunc/latest_checkpointed_iteration.txt"]),
    Case("pretrain-garbage-idx", "pretrain_gpt.py",
         lambda d: TINY + ["--data-path", f"{d}/garbage_idx"], r"garbage_idx"),
    Case("pretrain-short-bin", "pretrain_gpt.py",
         lambda d: TINY + ["--data-path", f"{d}/short_bin"], r"short_bin.*(bytes|bin)"),
    # --load without a checkpoint starts from scratch (Megatron-LM), with --finetune too;
    # --exit-on-missing-checkpoint needs one
    Case("pretrain-load-is-file", "pretrain_gpt.py", _pretrain("--load", "{d}/good.idx"), r"--load"),
    Case("pretrain-load-empty-dir-exit-on-missing", "pretrain_gpt.py",
         _pretrain("--load", "{d}/empty_ckpt", "--exit-on-missing-checkpoint"),
         r"no checkpoint in .*empty_ckpt \(--exit-on-missing-checkpoint needs one\)"),
    Case("pretrain-load-truncated-shard", "pretrain_gpt.py", _pretrain("--load", "{d}/ck_truncated"),
         r"no intact checkpoint in .*ck_truncated: iter_0000001 is damaged \(__0_0\.distcp has 100 bytes"),
    Case("pretrain-load-all-damaged", "pretrain_gpt.py", _pretrain("--load", "{d}/ck_all_damaged"),
         r"iter_0000002 is damaged \(no manifest\.json\); iter_0000001 is damaged \(.*fails its sha256", cold=True),
    Case("pretrain-load-garbage-manifest", "pretrain_gpt.py", _pretrain("--load", "{d}/ck_bad_manifest"),
         r"ck_bad_manifest.*manifest\.json unreadable"),
    # --save is checked before step 1 (it used to fail at the first save, after training)
    Case("pretrain-save-unwritable", "pretrain_gpt.py", _pretrain("--save", "{d}/good.idx/ck"),
         r"--save .*good\.idx/ck: .*good\.idx is a file, not a directory"),
    Case("pretrain-save-dir-is-file", "pretrain_gpt.py", _pretrain("--save", "{d}/lengths.json"),
         r"--save .*lengths\.json: .*lengths\.json is a file, not a directory"),
    Case("pretrain-keep-last-zero", "pretrain_gpt.py", _pretrain("--save", "{d}/ck_keep", "--keep-last", "0"),
         r"--keep-last", _p("{d}/ck_keep")),
    Case("pretrain-keep-last-without-save", "pretrain_gpt.py", _pretrain("--keep-last", "2"),
         r"--keep-last needs --save"),
    Case("pretrain-step-timeout-zero", "pretrain_gpt.py", _pretrain("--step-timeout-minutes", "0"),
         r"--step-timeout-minutes"),
    Case("pretrain-step-timeout-not-number", "pretrain_gpt.py", _pretrain("--step-timeout-minutes", "soon"),
         r"--step-timeout-minutes"),
    Case("pretrain-profile-of-another-model", "pretrain_gpt.py",
         _pretrain("--sparse-balance", "--sb-profile", "{d}/other_model_profile.json"),
         r"other_model_profile\.json.*(match|num_layers|block_size|hidden)"),
    Case("pretrain-profile-other-threads", "pretrain_gpt.py", _pretrain_sb("{d}/threads_profile.json"),
         STALE_THREADS),
    Case("pretrain-profile-truncated", "pretrain_gpt.py", _pretrain_sb("{d}/truncated_profile.json"),
         r"truncated_profile\.json.*not valid JSON"),
    Case("pretrain-profile-wrong-format", "pretrain_gpt.py", _pretrain_sb("{d}/wrong_schema.json"),
         r"wrong_schema\.json.*not a sparsebalance-latency-profile"),
    Case("pretrain-profile-missing", "pretrain_gpt.py", _pretrain_sb("{d}/no_profile.json"),
         r"no_profile\.json does not exist.*tools/profile_latency\.py", _p("{d}/no_profile.json")),
    Case("pretrain-stage-profile-missing", "pretrain_gpt.py",
         _pretrain("--sparse-balance", *SB_TINY, "--sb-cost-model", "h100-analytic", "--sb-stage-sensitivity",
                   "{d}/no_stage.json"), r"--sb-stage-sensitivity .*no_stage\.json: cannot read"),
    Case("pretrain-stage-profile-bad", "pretrain_gpt.py",
         _pretrain("--sparse-balance", *SB_TINY, "--sb-cost-model", "h100-analytic", "--sb-stage-sensitivity",
                   "{d}/stage_bad.json"), r"stage_bad\.json.*2-stage profile must have 2 finite values"),
    Case("pretrain-stage-profile-no-dst", "pretrain_gpt.py",
         _pretrain("--sparse-attention", *SB_TINY, "--sb-stage-sensitivity", "{d}/stage_bad.json"),
         r"--sb-stage-sensitivity refines DST's budgets: it needs --sb-dst"),
    # pretrain_gpt.py: activation recomputation flags (Megatron-LM's rules)
    Case("pretrain-loss-chunk-negative", "pretrain_gpt.py",
         _pretrain("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear",
                   "--sb-loss-chunk-tokens", "-1"), r"--sb-loss-chunk-tokens.*must be > 0"),
    Case("pretrain-loss-chunk-without-linear-fusion", "pretrain_gpt.py",
         _pretrain("--sb-loss-chunk-tokens", "4096"), r"--sb-loss-chunk-tokens.*--cross-entropy-fusion-impl linear"),
    Case("pretrain-cross-entropy-fusion-impl-unknown", "pretrain_gpt.py",
         _pretrain("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked"),
         r"--cross-entropy-fusion-impl.*invalid choice"),
    Case("pretrain-recompute-full-no-method", "pretrain_gpt.py",
         _pretrain("--recompute-granularity", "full", "--recompute-num-layers", "1"), r"--recompute-method"),
    Case("pretrain-recompute-full-no-num-layers", "pretrain_gpt.py",
         _pretrain("--recompute-granularity", "full", "--recompute-method", "uniform"), r"--recompute-num-layers"),
    Case("pretrain-recompute-selective-with-method", "pretrain_gpt.py",
         _pretrain("--recompute-granularity", "selective", "--recompute-method", "block"),
         r"selective.*--recompute-method"),
    Case("pretrain-recompute-too-many-layers", "pretrain_gpt.py",
         _pretrain("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"),
         r"--recompute-num-layers 3.*2 layers"),
    Case("pretrain-recompute-uniform-not-dividing", "pretrain_gpt.py",
         _pretrain("--num-layers", "3", "--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--recompute-num-layers", "2"), r"uniform.*divide"),
    Case("pretrain-recompute-unknown-granularity", "pretrain_gpt.py",
         _pretrain("--recompute-granularity", "partial"), r"--recompute-granularity.*partial"),
    Case("pretrain-overlap-param-gather-without-distopt", "pretrain_gpt.py",
         _pretrain("--overlap-param-gather", "--overlap-grad-reduce"),
         r"--overlap-param-gather.*--use-distributed-optimizer"),
    Case("pretrain-overlap-param-gather-without-grad-reduce", "pretrain_gpt.py",
         _pretrain("--use-distributed-optimizer", "--overlap-param-gather"),
         r"--overlap-param-gather needs --overlap-grad-reduce"),
    # pretrain_gpt.py: Megatron-LM flags it refuses (one line with the reason, never "unrecognized")
    Case("pretrain-megatron-moe-flag", "pretrain_gpt.py", _pretrain("--num-experts", "8", "--moe-router-topk", "2"),
         r"--moe-router-topk: mixture of experts is not supported|--num-experts: mixture of experts"),
    Case("pretrain-megatron-fp8-flag", "pretrain_gpt.py", _pretrain("--fp8-format", "hybrid"),
         r"--fp8-format: needs Transformer Engine"),
    Case("pretrain-batch-size-ramp", "pretrain_gpt.py", _pretrain("--step-batch-size-schedule", "0:2 1M:4",
                                                                  "--train-iters", "20000"),
         r"--step-batch-size-schedule '0:2 1M:4': the global batch would change from 2 to 4 at iteration 7814"),
    Case("pretrain-dev-dynamic-cp", "pretrain_gpt.py", _pretrain("--dynamic-context-parallel"),
         r"--dynamic-context-parallel: dynamic \(hybrid\) context parallelism .*sparsebalance\+dcp"),
    Case("pretrain-mindspeed-llm-flag", "pretrain_gpt.py", _pretrain("--use-mc2"),
         r"--use-mc2: a MindSpeed-LLM flag, not Megatron-LM's"),
    Case("pretrain-flagscale-flag", "pretrain_gpt.py", _pretrain("--skip-samples-range", "0", "10"),
         r"--skip-samples-range: a FlagScale flag, not Megatron-LM's"),
    Case("pretrain-pai-flag", "pretrain_gpt.py", _pretrain("--n-head-kv", "2"),
         r"--n-head-kv: a Pai-Megatron-Patch flag.*use --num-query-groups"),
    Case("pretrain-blend-missing-dataset", "pretrain_gpt.py",
         lambda d: TINY + ["--data-path", "0.5", f"{d}/good", "0.5", f"{d}/nothing"], r"nothing\.bin does not exist"),
    Case("pretrain-hf-tokenizer-hub-name", "pretrain_gpt.py",
         _pretrain("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "meta-llama/Llama-3-8B"),
         r"meta-llama/Llama-3-8B: not a local file or directory.*does not download"),
    # check_launch_script.py
    Case("check-launch-missing-script", "tools/check_launch_script.py", _p("{d}/none.sh"), r"none\.sh"),
    Case("check-launch-not-utf8", "tools/check_launch_script.py", _p("{d}/latin1.jsonl"),
         r"latin1\.jsonl.*UTF-8"),
    Case("check-launch-no-flags", "tools/check_launch_script.py", _p("{d}/blank.jsonl"), r"no --flags", cold=True),
    # preprocess_data.py: bad JSONL
    Case("preprocess-missing-input", "tools/preprocess_data.py",
         _p("--input", "{d}/none.jsonl", "--output-prefix", "{d}/pp0"), r"none\.jsonl",
         _p("{d}/pp0.bin", "{d}/pp0.idx")),
    Case("preprocess-empty-jsonl", "tools/preprocess_data.py",
         _p("--input", "{d}/empty.jsonl", "--output-prefix", "{d}/pp1"), r"no .*documents|empty",
         _p("{d}/pp1.bin", "{d}/pp1.idx")),
    Case("preprocess-blank-jsonl", "tools/preprocess_data.py",
         _p("--input", "{d}/blank.jsonl", "--output-prefix", "{d}/pp2"), r"no .*documents|empty",
         _p("{d}/pp2.bin", "{d}/pp2.idx")),
    Case("preprocess-non-utf8", "tools/preprocess_data.py",
         _p("--input", "{d}/latin1.jsonl", "--output-prefix", "{d}/pp3"), r"utf-?8|decode",
         _p("{d}/pp3.bin", "{d}/pp3.idx"), cold=True),
    Case("preprocess-bad-json", "tools/preprocess_data.py",
         _p("--input", "{d}/notjson.jsonl", "--output-prefix", "{d}/pp4"), r"notjson\.jsonl:2",
         _p("{d}/pp4.bin", "{d}/pp4.idx")),
    Case("preprocess-missing-key", "tools/preprocess_data.py",
         _p("--input", "{d}/nokey.jsonl", "--output-prefix", "{d}/pp5"), r"'text'",
         _p("{d}/pp5.bin", "{d}/pp5.idx")),
    Case("preprocess-non-string", "tools/preprocess_data.py",
         _p("--input", "{d}/notstr.jsonl", "--output-prefix", "{d}/pp6"), r"not a string",
         _p("{d}/pp6.bin", "{d}/pp6.idx")),
    Case("preprocess-hf-without-model", "tools/preprocess_data.py",
         _p("--input", "{d}/nokey.jsonl", "--output-prefix", "{d}/pp7", "--tokenizer-type",
            "HuggingFaceTokenizer"), r"tokenizer-model", _p("{d}/pp7.bin", "{d}/pp7.idx")),
    Case("preprocess-eod-byte-tokenizer", "tools/preprocess_data.py",
         _p("--input", "{d}/notstr.jsonl", "--output-prefix", "{d}/pp8", "--append-eod"), r"end-of-document",
         _p("{d}/pp8.bin", "{d}/pp8.idx")),
    Case("preprocess-workers-partitions", "tools/preprocess_data.py",
         _p("--input", "{d}/notstr.jsonl", "--output-prefix", "{d}/pp9", "--workers", "3", "--partitions", "2"),
         r"multiple of --partitions", _p("{d}/pp9.bin", "{d}/pp9.idx")),
    Case("preprocess-bad-json-workers", "tools/preprocess_data.py",
         _p("--input", "{d}/notjson.jsonl", "--output-prefix", "{d}/pp10", "--json-keys", "text", "--workers", "2"),
         r"notjson\.jsonl:2", _p("{d}/pp10_text_document.bin", "{d}/pp10_text_document.idx")),
    Case("bench-preprocess-one-worker", "benchmarks/bench_preprocess.py",
         _p("--workers", "1", "--workdir", "{d}/bp"), r"workers", _p("{d}/bp/corpus.jsonl"), cold=True),
    # dataset_lengths.py: a missing or corrupt dataset
    Case("lengths-missing-dataset", "tools/dataset_lengths.py", _p("--data-path", "{d}/only", "--output",
                                                                   "{d}/len0.json"), r"only\.bin",
         _p("{d}/len0.json"), cold=True),
    Case("lengths-corrupt-dataset", "tools/dataset_lengths.py", _p("--data-path", "{d}/trunc_idx", "--output",
                                                                   "{d}/len1.json"), r"trunc_idx",
         _p("{d}/len1.json")),
    # make_corpus.py: negative sizes, unknown length file
    Case("corpus-negative-docs", "tools/make_corpus.py",
         _p("--output-prefix", "{d}/mc1", "--num-docs", "-5"), r"num-docs", _p("{d}/mc1.bin", "{d}/mc1.idx"),
         cold=True),
    Case("corpus-tiny-length", "tools/make_corpus.py",
         _p("--output-prefix", "{d}/mc2", "--max-length", "1"), r"max-length", _p("{d}/mc2.bin", "{d}/mc2.idx")),
    Case("corpus-bad-quantile", "tools/make_corpus.py",
         _p("--output-prefix", "{d}/mc3", "--quantile", "1.5"), r"quantile", _p("{d}/mc3.bin", "{d}/mc3.idx")),
    Case("corpus-unknown-lengths", "tools/make_corpus.py",
         _p("--output-prefix", "{d}/mc4", "--lengths", "no_such_lengths"), r"no_such_lengths",
         _p("{d}/mc4.bin", "{d}/mc4.idx")),
    # make_hetero_corpus.py (all rejected before anything is written or trained)
    Case("hetero-negative-docs", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc1", "--num-docs", "-5"), r"num-docs",
         _p("{d}/hc1.bin", "{d}/hc1.idx", "{d}/hc1_sources.json"), cold=True),
    Case("hetero-unknown-source", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc2", "--sources", "code,poetry"), r"sources.*poetry",
         _p("{d}/hc2.bin", "{d}/hc2.idx", "{d}/hc2_sources.json")),
    Case("hetero-short-seq", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc3", "--seq-length", "8"), r"seq-length", _p("{d}/hc3.bin", "{d}/hc3.idx")),
    Case("hetero-unknown-lengths", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc4", "--lengths", "no_such_lengths"), r"no_such_lengths",
         _p("{d}/hc4.bin", "{d}/hc4.idx")),
    Case("hetero-checkpoint-is-file", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc5", "--train-checkpoint", "{d}/lengths.json"), r"lengths\.json",
         _p("{d}/hc5.bin", "{d}/hc5.idx")),
    Case("hetero-checkpoint-not-ours", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc6", "--num-docs", "20", "--seq-length", "64", "--train-checkpoint",
            "{d}/a_dir_with_file"), r"a_dir_with_file.*not empty", _p("{d}/hc6.bin", "{d}/hc6.idx")),
    Case("hetero-zero-iters", "benchmarks/make_hetero_corpus.py",
         _p("--output-prefix", "{d}/hc7", "--train-checkpoint", "{d}/hc7ck", "--train-iters", "0"),
         r"train-iters", _p("{d}/hc7.bin", "{d}/hc7ck")),
    # sparsity_study.py (all rejected before a model is built)
    Case("study-load-missing", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/no_ckpt", "--data-path", "{d}/good", "--output", "{d}/ss1.json"), r"no_ckpt",
         _p("{d}/ss1.json"), cold=True),
    Case("study-data-missing", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/no_data"), r"no_data"),
    Case("study-no-sidecar", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--output", "{d}/ss3.json"),
         r"good_sources\.json.*make_hetero_corpus", _p("{d}/ss3.json")),
    Case("study-sidecar-no-sources", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--sources-file", "{d}/wrong_schema.json"),
         r"wrong_schema\.json.*doc_source"),
    Case("study-sidecar-not-json", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--sources-file", "{d}/garbage.json"),
         r"garbage\.json.*JSON"),
    Case("study-tau-zero", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--tau", "0"), r"--tau"),
    Case("study-min-over-cap", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--topk", "2", "--topk-min", "3"), r"topk-min"),
    Case("study-output-no-dir", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--output", "{d}/no_dir/s.json"), r"no_dir"),
    Case("study-real-no-model-flags", "benchmarks/sparsity_study.py",
         _p("--real", "--load", "{d}/empty_ckpt", "--data-path", "{d}/good"), r"model_flags\.txt"),
    Case("study-real-sens-length", "benchmarks/sparsity_study.py",
         _p("--real", "--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--lengths", "1024",
            "--docs-per-source", "1", "--sens-lengths", "2048"), r"sens-lengths"),
    Case("study-dump-qk-not-real", "benchmarks/sparsity_study.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--dump-qk", "{d}/qk.pt"), r"dump-qk.*--real",
         _p("{d}/qk.pt")),
    # make_real_corpus.py (rejected before anything is written)
    Case("real-corpus-no-tokenizer", "benchmarks/make_real_corpus.py",
         _p("--tokenizer-model", "{d}/no_hf", "--output-prefix", "{d}/rc1"), r"no_hf", _p("{d}/rc1.jsonl"),
         cold=True),
    Case("real-corpus-unknown-source", "benchmarks/make_real_corpus.py",
         _p("--tokenizer-model", "{d}/good.bin", "--output-prefix", "{d}/rc2", "--sources", "code,poetry"),
         r"sources.*poetry", _p("{d}/rc2.jsonl")),
    # real_accuracy.py, sensitivity_sim.py, bench_sp_collectives.py (rejected before any work)
    Case("real-accuracy-no-model", "benchmarks/real_accuracy.py", _p("--load", "{d}/empty_ckpt"), r"model_flags\.txt",
         _p("{d}/ra.json"), cold=True),
    Case("real-accuracy-missing-study", "benchmarks/real_accuracy.py",
         _p("--load", "{d}/empty_ckpt", "--sensitivity", "estimate", "--sensitivity-study", "{d}/no_study.json",
            "--out", "{d}/ra2.json"), r"sensitivity-study.*no_study\.json", _p("{d}/ra2.json")),
    Case("real-accuracy-study-no-documents", "benchmarks/real_accuracy.py",
         _p("--load", "{d}/empty_ckpt", "--sensitivity", "estimate", "--sensitivity-study", "{d}/blank.jsonl"),
         r"sensitivity-study.*blank\.jsonl"),
    Case("real-accuracy-stage-without-profile", "benchmarks/real_accuracy.py",
         _p("--load", "{d}/empty_ckpt", "--sensitivity", "stage"), r"--sensitivity stage and --stage-sensitivity"),
    Case("real-accuracy-stage-profile-not-json", "benchmarks/real_accuracy.py",
         _p("--load", "{d}/empty_ckpt", "--sensitivity", "stage", "--stage-sensitivity", "{d}/blank.jsonl"),
         r"stage-sensitivity.*blank\.jsonl.*not JSON"),
    Case("real-accuracy-stage-profile-bad", "benchmarks/real_accuracy.py",
         _p("--load", "{d}/empty_ckpt", "--sensitivity", "stage", "--stage-sensitivity", "{d}/stage_bad.json",
            "--out", "{d}/ra3.json"), r"stage_bad\.json.*2-stage profile must have 2", _p("{d}/ra3.json")),
    # stage_sensitivity.py (rejected before the model is read)
    Case("stage-sensitivity-no-model", "benchmarks/stage_sensitivity.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--out", "{d}/ss1.json"), r"model_flags\.txt",
         _p("{d}/ss1.json"), cold=True),
    Case("stage-sensitivity-missing-data", "benchmarks/stage_sensitivity.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/nothing", "--out", "{d}/ss2.json"),
         r"--data-path.*nothing\.idx", _p("{d}/ss2.json")),
    Case("stage-sensitivity-bad-budgets", "benchmarks/stage_sensitivity.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--topk-min", "16", "--out", "{d}/ss3.json"),
         r"topk-min < --topk-max", _p("{d}/ss3.json")),
    Case("stage-sensitivity-bad-pp", "benchmarks/stage_sensitivity.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--pp", "4,x", "--out", "{d}/ss4.json"),
         r"--pp", _p("{d}/ss4.json")),
    Case("stage-sensitivity-too-few-documents", "benchmarks/stage_sensitivity.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--out", "{d}/ss5.json"),
         r"only 0 documents of >= 1536 tokens", _p("{d}/ss5.json")),
    # real_finetune.py (rejected before anything is written)
    Case("real-finetune-no-model", "benchmarks/real_finetune.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--workdir", "{d}/rfw1", "--out", "{d}/rf1.json"),
         r"model_flags\.txt", _p("{d}/rfw1", "{d}/rf1.json"), cold=True),
    Case("real-finetune-no-data", "benchmarks/real_finetune.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/nodata", "--workdir", "{d}/rfw2", "--out", "{d}/rf2.json"),
         r"nodata\.bin does not exist", _p("{d}/rfw2", "{d}/rf2.json")),
    Case("real-finetune-too-many-heldout", "benchmarks/real_finetune.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--heldout-docs", "6", "--workdir", "{d}/rfw3"),
         r"--heldout-docs must be in \[2, 5\]", _p("{d}/rfw3")),
    Case("real-finetune-zero-iters", "benchmarks/real_finetune.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--train-iters", "0", "--workdir", "{d}/rfw4"),
         r"--train-iters must be >= 1", _p("{d}/rfw4")),
    Case("real-finetune-short-sequence", "benchmarks/real_finetune.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--seq-length", "100", "--workdir", "{d}/rfw5"),
         r"--seq-length 100 is under two blocks", _p("{d}/rfw5")),
    Case("real-finetune-bad-number", "benchmarks/real_finetune.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--heldout-docs", "few"), r"--heldout-docs"),
    Case("real-finetune-out-dir-missing", "benchmarks/real_finetune.py",
         _p("--load", "{d}/flags_only", "--data-path", "{d}/good", "--out", "{d}/no_dir/rf.json", "--workdir",
            "{d}/rfw6"), r"--out", _p("{d}/rfw6")),
    Case("sensitivity-sim-missing-study", "benchmarks/sensitivity_sim.py", _p("run", "--study", "{d}/no_study.json"),
         r"no_study\.json", cold=True),
    Case("sensitivity-sim-study-no-documents", "benchmarks/sensitivity_sim.py",
         _p("run", "--study", "{d}/blank.jsonl", "--out", "{d}/sens.json"), r"blank\.jsonl", _p("{d}/sens.json")),
    Case("bench-sp-bad-sizes", "benchmarks/bench_sp_collectives.py", _p("--sizes", "12,abc"), r"sizes", cold=True),
    # make_longctx_data.py
    Case("longctx-negative-docs", "benchmarks/make_longctx_data.py",
         _p("--output-dir", "{d}/lc1", "--num-train-docs", "-1"), r"num-train-docs", _p("{d}/lc1/train.jsonl")),
    Case("longctx-zero-tokens", "benchmarks/make_longctx_data.py",
         _p("--output-dir", "{d}/lc2", "--max-tokens", "0"), r"max.tokens", _p("{d}/lc2/train.jsonl")),
    Case("longctx-unknown-task", "benchmarks/make_longctx_data.py",
         _p("--output-dir", "{d}/lc3", "--train-tasks", "no_such_task"), r"no_such_task", _p("{d}/lc3/train.jsonl"),
         cold=True),
    # bench_attention.py
    Case("gpu-check-unknown-part", "benchmarks/gpu_check.py", _p("--parts", "tests,nope", "--out", "{d}/gc1"),
         r"--parts", _p("{d}/gc1")),
    Case("gpu-check-bad-seq-lens", "benchmarks/gpu_check.py", _p("--seq-lens", "16k", "--out", "{d}/gc2"),
         r"--seq-lens", _p("{d}/gc2")),
    Case("gpu-check-out-is-file", "benchmarks/gpu_check.py", _p("--out", "{d}/good.idx"), r"--out", cold=True),
    Case("gpu-check-bad-train-quantile", "benchmarks/gpu_check.py",
         _p("--train-quantile", "1.5", "--out", "{d}/gc3"), r"--train-quantile", _p("{d}/gc3")),
    Case("gpu-check-bad-train-arms", "benchmarks/gpu_check.py",
         _p("--train-arms", "sparse,sparse", "--out", "{d}/gc4"), r"--train-arms", _p("{d}/gc4")),
    Case("profile-cv-missing-profile", "benchmarks/harness/gpu/profile_cv.py", _p("--profile", "{d}/no_profile.json"),
         r"no_profile.json", cold=True),
    Case("profile-cv-not-a-profile", "benchmarks/harness/gpu/profile_cv.py", _p("--profile", "{d}/good.idx"),
         r"--profile"),
    Case("train-mix-missing-report", "benchmarks/harness/gpu/train_mix.py",
         _p("--report", "{d}/no_report.json", "--run-quantile", "0.999"), r"no_report.json", cold=True),
    Case("train-mix-bad-quantile", "benchmarks/harness/gpu/train_mix.py",
         _p("--report", "{d}/no_report.json", "--run-quantile", "2"), r"quantile"),
    Case("triton-audit-unknown-kernel", "benchmarks/triton_resource_audit.py", _p("--kernels", "fwd,nope"), r"kernels",
         cold=True),
    Case("triton-audit-zero-head-dim", "benchmarks/triton_resource_audit.py", _p("--head-dim", "0"), r"head-dim"),
    Case("bench-negative-seq", "tools/bench_attention.py", _p("--seq-len", "-4"), r"seq-len"),
    Case("bench-unknown-backend", "tools/bench_attention.py", _p("--seq-len", "256", "--backend", "nope"),
         r"nope", cold=True),
    Case("bench-zero-block", "tools/bench_attention.py", _p("--seq-len", "256", "--block-size", "0"),
         r"block-size"),
    Case("bench-missing-docmix", "tools/bench_attention.py",
         _p("--seq-len", "256", "--doc-mix", "{d}/none.json", "--out", "{d}/bench.json"), r"none\.json",
         _p("{d}/bench.json")),
    Case("bench-garbage-docmix", "tools/bench_attention.py",
         _p("--seq-len", "256", "--doc-mix", "{d}/garbage.json", "--out", "{d}/bench2.json"), r"garbage\.json",
         _p("{d}/bench2.json")),
    Case("bench-docmix-not-lengths", "tools/bench_attention.py",
         _p("--seq-len", "256", "--doc-mix", "{d}/wrong_schema.json", "--out", "{d}/bench3.json"),
         r"wrong_schema\.json", _p("{d}/bench3.json")),
    Case("bench-missing-qk", "tools/bench_attention.py", _p("--qk", "{d}/none.pt", "--out", "{d}/bench4.json"),
         r"none\.pt", _p("{d}/bench4.json")),
    Case("bench-qk-not-a-pt", "tools/bench_attention.py", _p("--qk", "{d}/garbage.json", "--out", "{d}/bench5.json"),
         r"garbage\.json", _p("{d}/bench5.json")),
    # profile_latency.py
    Case("profile-negative-threads", "tools/profile_latency.py",
         _p("--output", "{d}/prof1.json", "--quick", "--threads", "-1"), r"threads", _p("{d}/prof1.json")),
    Case("profile-output-is-dir", "tools/profile_latency.py",
         _p("--output", "{d}/a_dir", "--quick"), r"a_dir", cold=True),
    Case("profile-no-output", "tools/profile_latency.py", _p("--quick"), r"--output"),
    Case("profile-heads-vs-hidden", "tools/profile_latency.py",
         _p("--output", "{d}/prof2.json", "--quick", "--hidden-size", "100", "--num-attention-heads", "3"),
         r"hidden-size", _p("{d}/prof2.json")),
    # propose_layout.py
    Case("propose-layout-garbage-lengths", "tools/propose_layout.py",
         _p("--model-preset", "qwen2.5-0.5b", "--pp", "4", "--seq-length", "4096", "--lengths", "{d}/garbage.json"),
         r"garbage\.json", cold=True),
    # simulate.py
    Case("simulate-missing-instance", "benchmarks/simulate.py",
         _p("run", "--instance", "{d}/none.json", "--trace", "{d}/sim1.trace.json"), r"none\.json",
         _p("{d}/sim1.trace.json")),
    Case("simulate-garbage-instance", "benchmarks/simulate.py",
         _p("run", "--instance", "{d}/garbage.json", "--trace", "{d}/sim2.trace.json"), r"garbage\.json",
         _p("{d}/sim2.trace.json")),
    Case("simulate-wrong-schema", "benchmarks/simulate.py",
         _p("run", "--instance", "{d}/wrong_schema.json", "--gantt", "{d}/sim3.png"),
         r"wrong_schema\.json|missing 'pp'",
         _p("{d}/sim3.png")),
    Case("simulate-profile-of-another-model", "benchmarks/simulate.py",
         _p("from-lengths", "--lengths", "{d}/lengths.json", "--predictor", "{d}/other_model_profile.json",
            "--num-layers", "24", "--block-size", "256", "--seq-length", "8192", "--pp", "2", "--dp", "1",
            "--microbatches", "2", "--out", "{d}/fl.json"),
         r"other_model_profile\.json.*(match|num_layers|block_size)", _p("{d}/fl.json")),
    Case("simulate-profile-other-threads", "benchmarks/simulate.py",
         _sim_profile("{d}/threads_profile.json", "{d}/fl2.json"), STALE_THREADS, _p("{d}/fl2.json")),
    Case("simulate-profile-truncated", "benchmarks/simulate.py",
         _sim_profile("{d}/truncated_profile.json", "{d}/fl3.json"), r"truncated_profile\.json.*not valid JSON",
         _p("{d}/fl3.json")),
    Case("simulate-profile-wrong-format", "benchmarks/simulate.py",
         _sim_profile("{d}/wrong_schema.json", "{d}/fl4.json"),
         r"wrong_schema\.json.*not a sparsebalance-latency-profile", _p("{d}/fl4.json")),
    Case("simulate-profile-missing", "benchmarks/simulate.py",
         _sim_profile("{d}/no_profile.json", "{d}/fl5.json"), r"no_profile\.json does not exist",
         _p("{d}/fl5.json", "{d}/no_profile.json"), cold=True),
    Case("simulate-binary-instance", "benchmarks/simulate.py",
         _p("run", "--instance", "{d}/good.idx", "--trace", "{d}/sim4.trace.json"), r"good\.idx",
         _p("{d}/sim4.trace.json")),
    Case("simulate-negative-pp", "benchmarks/simulate.py",
         _p("synth", "--pp", "-1", "--out", "{d}/inst.json"), r"--pp", _p("{d}/inst.json")),
    # timeline.py
    Case("timeline-binary-file", "tools/timeline.py", _p("--timeline", "a={d}/good.idx", "--trace", "{d}/tl0.json"),
         r"good\.idx", _p("{d}/tl0.json")),
    Case("timeline-missing-file", "tools/timeline.py",
         _p("--timeline", "a={d}/none.json", "--trace", "{d}/tl1.json"), r"none\.json", _p("{d}/tl1.json"), cold=True),
    Case("timeline-empty-file", "tools/timeline.py",
         _p("--timeline", "a={d}/empty.json", "--gantt", "{d}/tl2.png"), r"empty\.json", _p("{d}/tl2.png")),
    # compare.py
    Case("compare-negative-pp", "benchmarks/compare.py",
         _p("--quick", "--pp", "-2", "--report", "{d}/cmp1"), r"--pp", _p("{d}/cmp1/report.md")),
    Case("compare-missing-lengths", "benchmarks/compare.py",
         _p("--quick", "--lengths", "{d}/none.json", "--report", "{d}/cmp2"), r"none\.json",
         _p("{d}/cmp2/report.md")),
    Case("compare-profile-other-threads", "benchmarks/compare.py", _compare_sim("{d}/threads_profile.json", 3),
         STALE_THREADS, _p("{d}/cmp3/report.md")),
    Case("compare-profile-bad-types", "benchmarks/compare.py", _compare_sim("{d}/bad_types_profile.json", 4),
         r"bad_types_profile\.json: 'hardware' must be a JSON dict", _p("{d}/cmp4/report.md")),
    Case("compare-profile-missing", "benchmarks/compare.py", _compare_sim("{d}/no_profile.json", 5),
         r"no_profile\.json does not exist", _p("{d}/no_profile.json", "{d}/cmp5/report.md"), cold=True),
    # python -m sparsebalance.batching pack --cost-model PROFILE
    Case("batching-profile-other-threads", "-m sparsebalance.batching", _pack("{d}/threads_profile.json"),
         STALE_THREADS, cold=True),
    Case("batching-profile-of-another-model", "-m sparsebalance.batching",
         _pack("{d}/other_model_profile.json", ("hidden_size", 64)),
         r"other_model_profile\.json.*model\.block_size: profile 128, now 32"),
    Case("batching-profile-truncated", "-m sparsebalance.batching", _pack("{d}/truncated_profile.json"),
         r"truncated_profile\.json.*not valid JSON"),
    Case("batching-profile-wrong-format", "-m sparsebalance.batching", _pack("{d}/wrong_schema.json"),
         r"wrong_schema\.json.*not a sparsebalance-latency-profile"),
    Case("batching-profile-missing", "-m sparsebalance.batching", _pack("{d}/no_profile.json"),
         r"no_profile\.json does not exist", _p("{d}/no_profile.json")),
    # examples/longctx/curriculum.py (the base model's stages; nothing is trained on bad input)
    Case("curriculum-garbage-file", "examples/longctx/curriculum.py",
         _p("--stages", "{d}/garbage.json", "--runs-dir", "{d}/cur1", "--data-dir", "{d}/curd1"), r"garbage\.json",
         _p("{d}/cur1", "{d}/curd1")),
    Case("curriculum-no-stages", "examples/longctx/curriculum.py",
         _p("--stages", "{d}/wrong_schema.json", "--runs-dir", "{d}/cur2", "--data-dir",
            "{d}/curd2"), r"stages|unknown",
         _p("{d}/cur2", "{d}/curd2")),
    Case("curriculum-doc-longer-than-seq", "examples/longctx/curriculum.py",
         _p("--stages", "{d}/stages_too_long.json", "--runs-dir", "{d}/cur3", "--data-dir", "{d}/curd3"),
         r"1024.*seq_length 512", _p("{d}/cur3", "{d}/curd3")),
    Case("curriculum-unknown-key", "examples/longctx/curriculum.py",
         _p("--stages", "{d}/stages_unknown_key.json", "--runs-dir", "{d}/cur4", "--data-dir", "{d}/curd4"),
         r"unknown key.*warmup", _p("{d}/cur4", "{d}/curd4")),
    Case("curriculum-until-unknown", "examples/longctx/curriculum.py",
         _p("--stages", "{d}/stages_ok.json", "--until", "zz", "--runs-dir", "{d}/cur5", "--data-dir", "{d}/curd5"),
         r"--until.*zz", _p("{d}/cur5", "{d}/curd5"), cold=True),
    # checkpoint/convert.py
    Case("convert-wrong-architecture", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_mistral", "--output", "{d}/cv1"), r"MistralForCausalLM",
         _p("{d}/cv1")),
    Case("convert-missing-tensor", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_missing", "--output", "{d}/cv2"), r"missing tensor.*up_proj",
         _p("{d}/cv2")),
    Case("convert-index-names-tensor-its-shard-lacks", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_shard_lacks", "--output", "{d}/cv8"),
         r"missing tensor model\.layers\.0\.self_attn\.k_proj\.weight: the index puts it in "
         r".*model-00001-of-00001\.safetensors, which does not hold it", _p("{d}/cv8")),
    Case("convert-model-type-disagrees-with-architectures", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_type_mismatch", "--output", "{d}/cv9"),
         r"model_type 'mistral' disagrees with architectures \['Qwen2ForCausalLM'\]", _p("{d}/cv9")),
    Case("convert-shape-mismatch", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_shape", "--output", "{d}/cv3"), r"shape \[20, 16\].*\[24, 16\]",
         _p("{d}/cv3"), cold=True),
    Case("convert-vocab-does-not-fit", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_vocab", "--output", "{d}/cv4"), r"40 tokens.*vocab_size is 32",
         _p("{d}/cv4")),
    Case("convert-no-weights", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_noweights", "--output", "{d}/cv5"), r"model\.safetensors",
         _p("{d}/cv5")),
    Case("convert-output-not-empty", "tools/checkpoint/convert.py",
         _p("hf-to-megatron", "--hf-dir", "{d}/hf_good", "--output", "{d}/a_dir_with_file"), r"--output"),
    Case("convert-load-missing", "tools/checkpoint/convert.py",
         _p("megatron-to-hf", "--load", "{d}/no_ckpt", "--hf-config", "{d}/hf_good", "--output", "{d}/cv6"),
         r"no_ckpt", _p("{d}/cv6")),
    Case("convert-load-empty", "tools/checkpoint/convert.py",
         _p("megatron-to-hf", "--load", "{d}/empty_ckpt", "--hf-config", "{d}/hf_good", "--output", "{d}/cv7"),
         r"empty_ckpt", _p("{d}/cv7")),
    Case("convert-no-subcommand", "tools/checkpoint/convert.py", _p(), r"command|required"),
    # attention_recall.py
    Case("recall-load-missing", "benchmarks/attention_recall.py",
         _p("--load", "{d}/no_ckpt", "--data-path", "{d}/good", "--plot", "{d}/rc1.png"), r"no_ckpt",
         _p("{d}/rc1.png")),
    Case("recall-load-empty-dir", "benchmarks/attention_recall.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--plot", "{d}/rc2.png"), r"empty_ckpt",
         _p("{d}/rc2.png"), cold=True),
    Case("recall-data-missing", "benchmarks/attention_recall.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/no_data"), r"no_data"),
    Case("recall-budget-not-json", "benchmarks/attention_recall.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--budgets", "dst={d}/garbage.json"),
         r"garbage\.json.*JSON"),
    Case("recall-budget-no-table", "benchmarks/attention_recall.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--budgets", "dst={d}/wrong_schema.json"),
         r"wrong_schema\.json.*budget"),
    Case("recall-budget-missing-file", "benchmarks/attention_recall.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--budgets", "dst={d}/nope.json"),
         r"nope\.json"),
    Case("recall-budget-no-name", "benchmarks/attention_recall.py",
         _p("--load", "{d}/empty_ckpt", "--data-path", "{d}/good", "--budgets", "{d}/lengths.json"), r"NAME=FILE"),
    # eval_longctx.py
    Case("eval-load-missing", "benchmarks/eval_longctx.py",
         _p("--load", "{d}/no_ckpt", "--output", "{d}/ev1.json"), r"no_ckpt", _p("{d}/ev1.json")),
    Case("eval-load-empty-dir", "benchmarks/eval_longctx.py",
         _p("--load", "{d}/empty_ckpt", "--output", "{d}/ev2.json"), r"empty_ckpt|checkpoint", _p("{d}/ev2.json"),
         cold=True),
    Case("eval-empty-data", "benchmarks/eval_longctx.py",
         _p("--load", "{d}/empty_ckpt", "--data", "{d}/empty.jsonl", "--output", "{d}/ev3.json"),
         r"empty|checkpoint", _p("{d}/ev3.json")),
    # fault_trials.py (all rejected before any corpus or training run)
    Case("faults-trials-zero", "benchmarks/fault_trials.py", _p("--trials", "0"), r"--trials"),
    Case("faults-trials-missing", "benchmarks/fault_trials.py", _p("--seed", "1"), r"--trials"),
    Case("faults-seed-negative", "benchmarks/fault_trials.py", _p("--trials", "1", "--seed", "-1"), r"--seed",
         cold=True),
    Case("faults-data-missing", "benchmarks/fault_trials.py", _p("--trials", "1", "--data-path", "{d}/nope"),
         r"nope\.bin"),
    Case("faults-output-no-dir", "benchmarks/fault_trials.py",
         _p("--trials", "1", "--output", "{d}/no_dir/faults.json"), r"no_dir"),
    Case("faults-no-checkpoint-to-resume", "benchmarks/fault_trials.py",
         _p("--trials", "1", "--train-iters", "2", "--save-interval", "2"), r"--save-interval"),
    Case("faults-work-dir-is-file", "benchmarks/fault_trials.py",
         _p("--trials", "1", "--work-dir", "{d}/lengths.json"), r"lengths\.json"),
    # heldout_loss.py (all rejected before any corpus, profile or training run)
    Case("heldout-budget-zero", "benchmarks/heldout_loss.py",
         _p("--budget-s", "0", "--workdir", "{d}/hl1", "--out", "{d}/hl1.json"), r"budget-s",
         _p("{d}/hl1", "{d}/hl1.json")),
    Case("heldout-seeds-not-int", "benchmarks/heldout_loss.py",
         _p("--seeds", "1,x", "--workdir", "{d}/hl2"), r"seeds", _p("{d}/hl2")),
    Case("heldout-seeds-repeated", "benchmarks/heldout_loss.py",
         _p("--seeds", "1,1", "--workdir", "{d}/hl3"), r"seeds", _p("{d}/hl3")),
    Case("heldout-docs-zero", "benchmarks/heldout_loss.py",
         _p("--heldout-docs", "0", "--workdir", "{d}/hl4"), r"heldout-docs", _p("{d}/hl4")),
    Case("heldout-out-no-dir", "benchmarks/heldout_loss.py",
         _p("--out", "{d}/no_dir/hl.json", "--workdir", "{d}/hl5"), r"no_dir", _p("{d}/hl5")),
    Case("heldout-workdir-is-file", "benchmarks/heldout_loss.py",
         _p("--workdir", "{d}/lengths.json", "--plot", "{d}/hl6.png"), r"lengths\.json", _p("{d}/hl6.png"), cold=True),
    Case("heldout-unknown-arm", "benchmarks/heldout_loss.py",
         _p("--arms", "static,nope", "--workdir", "{d}/hl7"), r"arms.*nope", _p("{d}/hl7")),
]


def case_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", WORLD_SIZE="1")
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(k, None)
    return env


def run_case(case: Case, d: str, warm: WarmRunner | None = None) -> subprocess.CompletedProcess | None:
    """Run ``case`` cold (a fresh interpreter) or, given ``warm``, forked from a warm one."""
    env = case_env()
    if case.script.startswith("-m "):
        module = case.script[3:]
        if not os.path.isdir(os.path.join(REPO, *module.split("."))):
            return None
        cmd = [PY, "-m", module]
        env["PYTHONPATH"] = REPO
    else:
        script = os.path.join(REPO, case.script)
        if not os.path.isfile(script):
            return None
        cmd = [PY, script]
    cmd = [*cmd, *case.argv(d)]
    if warm is not None and not case.cold:
        return warm.run(cmd, d, env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=d, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    """Two warm runners, shared by the module's tests."""
    io_dir = str(tmp_path_factory.mktemp("bad_input_io"))
    pool = queue.Queue()
    for _ in range(2):
        pool.put(WarmRunner(io_dir, case_env(), TIMEOUT_S))
    yield pool
    while not pool.empty():
        pool.get().close()


@pytest.fixture(scope="module")
def results(tmp_path_factory, runners):
    """Every case's CompletedProcess: cold cases first (fresh interpreters), then the rest
    forked from the warm runners, two at a time."""
    d = str(tmp_path_factory.mktemp("bad_input"))
    make_bad_files(d)

    def run(case):
        warm = runners.get()
        try:
            return run_case(case, d, warm)
        finally:
            runners.put(warm)

    with ThreadPoolExecutor(2) as pool:
        ordered = sorted(CASES, key=lambda c: not c.cold)
        done = dict(zip((c.id for c in ordered), pool.map(run, ordered)))
    return d, done


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly(case, results):
    d, done = results
    r = done[case.id]
    if r is None:
        if case.script == "pretrain_gpt.py":
            pytest.fail("pretrain_gpt.py does not exist")
        pytest.skip(f"{case.script} not present")
    shown = f"\n--- exit {r.returncode}\n--- stderr:\n{r.stderr[-1500:]}\n--- stdout:\n{r.stdout[-500:]}"
    assert r.returncode != 0, "exited 0 on bad input" + shown
    assert "Traceback" not in r.stderr + r.stdout, "traceback instead of one error line" + shown
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}" + shown
    assert re.search(case.mention, lines[0], re.IGNORECASE), \
        f"error line does not name the problem (/{case.mention}/)" + shown
    left = [p for p in case.no_outputs(d) if os.path.exists(p)]
    assert not left, f"output left behind: {left}" + shown
    # No temporary siblings of the outputs either (write-temp-then-rename must clean up).
    for p in case.no_outputs(d):
        parent, base = os.path.split(p)
        if os.path.isdir(parent):
            stray = [f for f in os.listdir(parent) if f.startswith(base + ".") or f.startswith(base + "-tmp")]
            assert not stray, f"temporary files left behind: {stray}" + shown


def test_every_tool_has_cases():
    covered = {c.script for c in CASES}
    tools = {f"{d}/{f}" for d in ("tools", "benchmarks") for f in os.listdir(os.path.join(REPO, d))
             if f.endswith(".py") and not f.startswith("_")}
    assert tools - covered == set(), f"tools without bad-input cases: {sorted(tools - covered)}"
    assert "pretrain_gpt.py" in covered
    cold = [c.script for c in CASES if c.cold]
    assert sorted(cold) == sorted(covered), "each script needs exactly one cold case"


PROBE = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("PROBE"))
print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
what = sys.argv[1]
if what == "raise":
    raise ValueError("boom")
if what == "message":
    sys.exit("one line on stderr")
if what == "code":
    sys.exit(3)
if what == "kill":
    os.kill(os.getpid(), 9)
print("fine", file=sys.stderr)
"""


@pytest.mark.parametrize("what", ["raise", "message", "code", "kill", "ok"])
def test_warm_runner_behaves_like_python(what, tmp_path, runners):
    """Exit status, stdout, stderr (a traceback included), argv, cwd, env and sys.path[0]
    of a forked case are those of ``python SCRIPT ARGS``."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(case_env(), PROBE="seen")
    cold = subprocess.run([PY, str(script), what], capture_output=True, text=True, cwd=work, env=env,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    runner = runners.get()
    try:
        warm = runner.run([PY, str(script), what], work, env)
    finally:
        runners.put(runner)
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout)
    assert cold.stdout.startswith(f"argv ['{what}'] cwd work env seen\npath0 True")
    if what == "raise":  # the same traceback but for the runner's frames
        assert warm.stderr.startswith("Traceback") and warm.stderr.endswith("ValueError: boom\n")
    else:
        assert warm.stderr == cold.stderr
    assert cold.returncode == {"raise": 1, "message": 1, "code": 3, "kill": -9, "ok": 0}[what]
