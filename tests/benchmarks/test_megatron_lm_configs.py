"""benchmarks/harness/megatron_lm_configs.py on a made-up checkout: inference cases are skipped,
each flag use is classified, and a path that is no checkout is one error line."""

import json
import os

import pytest

from benchmarks.harness.megatron_lm_configs import main

TRAIN = """MODEL_ARGS:
  --num-layers: 2
  --use-mcore-models: true
  --no-load-rng: false
  --micro-batch-size: 4
  --log-progress: true
  --moe-router-topk: 2
  --not-a-flag-anywhere: 3
"""
INFER = """MODEL_ARGS:
  --num-layers: 2
  --prompts: "hello"
"""


def test_counts_training_configs_by_status(tmp_path, capsys):
    for name, text in (("train_case", TRAIN), ("infer_case", INFER)):
        d = tmp_path / "tests" / "functional_tests" / "test_cases" / "gpt" / name
        os.makedirs(d)
        (d / "model_config.yaml").write_text(text)
    main(["--megatron-lm", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert out["configs"] == 2 and out["training_configs"] == 1
    # --no-load-rng false is left out; mbs 4 is honoured (4 x --seq-length tokens a packed
    # micro-batch), MoE is refused, the logging extra is ignored
    assert out["counts"] == {"honoured": 3, "unsupported": 1, "ignored": 1, "unrecognized": 1}
    assert out["honoured_fraction"] == round(3 / 6, 4) and out["unrecognized"] == [["--not-a-flag-anywhere", 1]]
    assert [r[0].split(":")[0] for r in out["top_refused"]] == ["--moe-router-topk"]


# Megatron-LM accepts both whole (a warmup longer than the run ends in warmup; the data path
# is a shell variable); the trainer refuses the MoE one, naming its flag
WHOLE = {
    "warmup_longer_than_run": """MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 64
  --max-position-embeddings: 64
  --micro-batch-size: 1
  --train-iters: 50
  --lr-decay-iters: 320000
  --lr-warmup-fraction: .01
  --data-path: ${DATA_PATH}/my-gpt3_00_text_document
  --split: 949,50,1
  --vocab-file: ${DATA_PATH}/bpe/vocab.json
  --merge-file: ${DATA_PATH}/bpe/merges.txt
  --save: ${CHECKPOINT_SAVE_PATH}
  --load: ${CHECKPOINT_LOAD_PATH}
  --seed: ${REPEAT}
  --step-batch-size-schedule: "0:8"
""",
    "tied_pp2": """MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 64
  --max-position-embeddings: 64
  --pipeline-model-parallel-size: 2
  --bf16: true
  --mock-data: true
  --tokenizer-type: NullTokenizer
  --vocab-size: 100
""",
    "moe": """MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --mock-data: true
  --tokenizer-type: NullTokenizer
  --vocab-size: 100
  --num-experts: 4
""",
}


def test_whole_configs_judged_by_the_trainer(tmp_path, capsys):
    for name, text in WHOLE.items():
        d = tmp_path / "tests" / "functional_tests" / "test_cases" / "gpt" / name
        os.makedirs(d)
        (d / "model_config.yaml").write_text(text)
    main(["--megatron-lm", str(tmp_path)])
    cpu = json.loads(capsys.readouterr().out)
    # on CPU --bf16 needs CUDA; without it tied embeddings over PP 2 run here too
    assert cpu["whole_configs_accepted"] == 1 and cpu["whole_configs_accepted_without_hardware_flags"] == 2
    assert not any("tied embeddings" in r for r, _ in cpu["whole_configs_refused_by"])
    main(["--megatron-lm", str(tmp_path), "--cuda"])
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["training_configs"] == 3 and gpu["whole_configs_accepted"] == 2
    assert gpu["whole_configs_accepted_fraction"] == round(2 / 3, 4)
    assert gpu["whole_configs_refused_for_unsupported_feature"] == 1
    assert [r.split(":")[0] for r, _ in gpu["whole_configs_refused_by"]] == ["--num-experts"]


def test_not_a_checkout_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--megatron-lm", str(tmp_path)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1 and "no tests/functional_tests there" in err[0], err


def test_tokenizer_files_under_the_data_dir_get_stand_ins(tmp_path):
    """A config's --vocab-file / --merge-file under ${DATA_PATH} are files its cluster has: the
    harness writes a loadable GPT-2 BPE pair there (with the FIM tokens), so the line is
    judged on its flags, not on a missing file."""
    from benchmarks.harness.megatron_lm_configs import FIM_TOKENS, config_argv

    flags = [("--tokenizer-type", ["GPT2BPETokenizer"]),
             ("--vocab-file", ["${DATA_PATH}/bpe/vocab.json"]), ("--merge-file", ["${DATA_PATH}/bpe/merges.txt"])]
    argv = config_argv(flags, str(tmp_path), str(tmp_path / "data"))
    vocab, merges = argv[argv.index("--vocab-file") + 1], argv[argv.index("--merge-file") + 1]
    assert vocab == str(tmp_path / "DATA_PATH" / "bpe" / "vocab.json")
    table = json.load(open(vocab))
    assert len(table) == 256 + len(FIM_TOKENS) and all(t in table for t in FIM_TOKENS)
    assert sorted(table.values()) == list(range(len(table)))
    from megatron.training.tokenizer import build_tokenizer

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok.vocab_size == len(table)


def test_square_brackets_are_stripped_as_megatron_lms_launcher_does():
    """_run_training.sh strips a value's [ ]: ``"[2 2]"`` is the two values 2 2 (Megatron-LM's
    resume_torch_dist_cp4_a2a_p2p config spells --hierarchical-context-parallel-sizes so)."""
    from benchmarks.harness.megatron_lm_configs import config_flags

    flags = config_flags({"--hierarchical-context-parallel-sizes": "[2 2]", "--cp-comm-type": "a2a+p2p",
                          "--step-batch-size-schedule": "0:384 200B:768", "--bf16": True})
    assert flags == [("--hierarchical-context-parallel-sizes", ["2", "2"]), ("--cp-comm-type", ["a2a+p2p"]),
                     ("--step-batch-size-schedule", ["0:384", "200B:768"]), ("--bf16", [])]


def test_train_check_shrinks_sizes_and_keeps_the_layout():
    """The 2-iteration CPU check (megatron_lm_configs_train) changes sizes only: hidden 8 per
    head (at least 64), sequence 128, micro-batches of one sequence, as many per data-parallel
    rank as the config has (at most 2 x PP), 2 iterations; layers, heads and the parallel layout
    stay; DP is capped (a size like the batch)."""
    from benchmarks.harness.megatron_lm_configs_train import cpu_world, shrink

    flags = [("--num-layers", ["12"]), ("--hidden-size", ["512"]), ("--num-attention-heads", ["8"]),
             ("--ffn-hidden-size", ["2048"]), ("--seq-length", ["1024"]), ("--max-position-embeddings", ["1024"]),
             ("--micro-batch-size", ["4"]), ("--global-batch-size", ["32"]), ("--train-iters", ["50"]),
             ("--tensor-model-parallel-size", ["2"]), ("--pipeline-model-parallel-size", ["2"]),
             ("--eval-iters", ["10"]), ("--lr", ["1e-4"])]
    # 8 ranks: TP 2 x PP 2 x DP 2; 32 / (4 x 2) = 4 micro-batches per DP rank = 2 x PP
    assert cpu_world(flags, 8) == 8 and cpu_world(flags, 1) == 4
    got = dict(shrink(flags, 2, dp=1, dp_given=2))
    assert got["--hidden-size"] == ["64"] and got["--ffn-hidden-size"] == ["128"]
    assert got["--seq-length"] == got["--max-position-embeddings"] == ["128"]
    assert (got["--micro-batch-size"], got["--global-batch-size"]) == (["1"], ["4"])
    assert (got["--train-iters"], got["--eval-iters"]) == (["2"], ["1"])
    for kept in ("--num-layers", "--num-attention-heads", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--lr"):
        assert got[kept] == dict(flags)[kept]
    many = dict(shrink([*flags[:6], ("--micro-batch-size", ["1"]), ("--global-batch-size", ["256"]),
                        ("--pipeline-model-parallel-size", ["2"])], 2, dp=2, dp_given=2))
    assert many["--global-batch-size"] == ["8"]  # 128 a rank -> 2 x PP = 4, times DP 2
    assert dict(shrink([("--num-attention-heads", ["12"]), ("--train-samples", ["1000"]),
                        ("--global-batch-size", ["6"])]))["--train-samples"] == ["4"]  # 2 x 2 micro-batches
    # the batch of a --step-batch-size-schedule (gpt3_15b_8t_release: 384 sequences) shrinks alike
    ramp = dict(shrink([("--num-attention-heads", ["48"]), ("--micro-batch-size", ["4"]), ("--train-samples", ["9"]),
                        ("--step-batch-size-schedule", ["0:384", "200B:768", "400B:1152"])]))
    assert ramp["--step-batch-size-schedule"] == ["0:2", "200B:2", "400B:2"] and ramp["--train-samples"] == ["4"]


def test_train_check_writes_a_loadable_hf_tokenizer(tmp_path):
    from benchmarks.harness.megatron_lm_configs import FIM_TOKENS
    from benchmarks.harness.megatron_lm_configs_train import tokenizer_stand_in
    from megatron.training.tokenizer import build_tokenizer

    folder = str(tmp_path / "CHECKPOINT_LOAD_PATH" / "tokenizer")
    assert tokenizer_stand_in([("--tokenizer-type", ["HuggingFaceTokenizer"]),
                               ("--tokenizer-model", [folder])]) is None
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    assert tok.vocab_size == 256 + len(FIM_TOKENS)
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"


def test_train_check_writes_a_loadable_sentencepiece_model(tmp_path):
    """At the exact path the config names (the trainer writes PREFIX.model; the stand-in is renamed)."""
    from benchmarks.harness.megatron_lm_configs_train import tokenizer_stand_in
    from megatron.training.tokenizer import build_tokenizer

    model = str(tmp_path / "DATA_PATH" / "utils" / "nemotron_2_256k.model")
    assert tokenizer_stand_in([("--tokenizer-type", ["GPTSentencePieceTokenizer"]),
                               ("--tokenizer-model", [model])]) is None
    assert sorted(p.name for p in (tmp_path / "DATA_PATH" / "utils").iterdir()) == ["nemotron_2_256k.model"]
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert tok.vocab_size == 200
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_train_check_resume_keeps_a_pass_marked_once(tmp_path):
    """A pass kept from an earlier run (--resume) is not run again and says so once, however
    many runs it was carried through."""
    from benchmarks.harness.megatron_lm_configs_train import measure

    d = tmp_path / "tests" / "functional_tests" / "test_cases" / "gpt" / "warmup_longer_than_run"
    os.makedirs(d)
    (d / "model_config.yaml").write_text(WHOLE["warmup_longer_than_run"])
    previous = {"warmup_longer_than_run": {"config": "warmup_longer_than_run", "world_size": 1, "passed": True,
                                           "reason": "losses 6.1, 6.0 (--resume) (--resume)", "same_line_as": None,
                                           "wall_s": 1.5}}
    rows = measure(str(tmp_path), previous=previous)["configs"]
    assert [(r["config"], r["passed"], r["reason"]) for r in rows] == \
        [("warmup_longer_than_run", True, "losses 6.1, 6.0 (--resume)")]
