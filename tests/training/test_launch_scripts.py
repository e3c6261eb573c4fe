"""A Megatron-LM user's launch script runs unchanged (issue 33's targets).

Three held-out launch scripts in ``launch_scripts/`` (written for this test from what
Megatron-LM's example scripts and Llama / Qwen2.5 community scripts pass, sizes shrunk
to a CPU run) are classified by ``megatron.training.launch_check`` (what
``tools/check_launch_script.py`` prints) and then trained for 2 iterations on CPU with
the flags refused for missing hardware dropped. Measured per script: the share of flags
honoured (target >= 95% of the flags not refused for hardware), 0 "unrecognized" for
Megatron-LM flags, 0 tracebacks, 2 iterations trained. The three CPU runs are single
processes of one thread each, so they run two at a time (module fixture).
"""

import json
import os
import subprocess

import pytest
from conftest import PRETRAIN, PY, ROOT, env, summary_of

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = sorted(f for f in os.listdir(os.path.join(HERE, "launch_scripts")) if f.endswith(".sh"))


def make_tokenizer_files(d: str) -> dict:
    """A tiny byte-level BPE trained here: vocab.json + merges.txt (GPT2BPETokenizer) and a
    directory holding its tokenizer.json (HuggingFaceTokenizer). Ids 0..255 are the bytes'
    (the test corpus's ids are < 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    bpe = os.path.join(d, "gpt2")
    os.makedirs(bpe)
    tok.model.save(bpe)  # vocab.json, merges.txt
    hf = os.path.join(d, "hf_tokenizer")
    os.makedirs(hf)
    tok.save(os.path.join(hf, "tokenizer.json"))
    return {"VOCAB_FILE": os.path.join(bpe, "vocab.json"), "MERGE_FILE": os.path.join(bpe, "merges.txt"),
            "TOKENIZER_DIR": hf}


@pytest.fixture(scope="module")
def paths(tmp_path_factory, corpus):
    d = str(tmp_path_factory.mktemp("launch"))
    out = make_tokenizer_files(d)
    out.update(DATA_PATH=corpus, DATA_PATH2=corpus, CACHE_DIR=os.path.join(d, "cache"))
    return d, out


def script_text(name: str, variables: dict, run_dir: str) -> str:
    text = open(os.path.join(HERE, "launch_scripts", name)).read()
    variables = dict(variables, CHECKPOINT_PATH=os.path.join(run_dir, "ckpt"),
                     TENSORBOARD_LOGS_PATH=os.path.join(run_dir, "tb"))
    for k in sorted(variables, key=len, reverse=True):  # DATA_PATH2 before DATA_PATH
        text = text.replace("${" + k + "}", variables[k]).replace("$" + k, variables[k])
    return text


@pytest.fixture(scope="module")
def runs(paths, world):
    """Per script: its classified flags and the CPU run of its runnable argv (in the world)."""
    from megatron.training.launch_check import classify, runnable_argv, script_flags

    d, variables = paths
    rows = {name: classify(script_flags(script_text(name, variables, os.path.join(d, name[:-3]))))
            for name in SCRIPTS}

    procs = {name: world.launch(PRETRAIN, [*runnable_argv(rows[name]), "--no-progress-bar"], timeout=300)
             for name in SCRIPTS}
    return {name: (rows[name], procs[name]) for name in SCRIPTS}


@pytest.mark.parametrize("name", SCRIPTS)
def test_launch_script_runs_unchanged(name, runs):
    """>= 95% of its flags honoured (of those not refused for missing hardware), no
    Megatron-LM flag "unrecognized", none unsupported, and 2 iterations train on CPU
    with exactly the hardware-refused flags dropped."""
    from megatron.training.launch_check import summarize

    rows, proc = runs[name]
    s = summarize(rows)
    print(f"{name}: {json.dumps({k: s[k] for k in ('flags', 'counts', 'honoured_fraction')})}")
    assert s["flags"] >= 30, "the script's flags were not read"
    assert s["megatron_lm_flags_unrecognized"] == 0, [r for r in rows if r["status"] == "unrecognized"]
    assert s["counts"].get("unsupported", 0) == 0, [r for r in rows if r["status"] == "unsupported"]
    assert s["honoured_fraction"] >= 0.95, s
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    summary = summary_of(proc)
    assert summary["iterations"] == 2
    ignored = [r["flag"] for r in rows if r["status"] == "ignored"]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("pretrain_gpt.py: warning:")]
    for flag in ignored:  # accepted without effect: never silently
        assert any(flag in ln for ln in warnings), (flag, warnings)


def test_check_launch_script_tool(paths, tmp_path):
    """The user-facing tool's --json report: this machine refuses the whole line (it has
    --bf16 and FP8 flags), the line without its hardware-bound flags is accepted, exit 1;
    --transformer-impl transformer_engine stays on the line (the local spec trains here)."""
    _, variables = paths
    script = tmp_path / "llama.sh"
    script.write_text(script_text("llama3_te_fp8.sh", variables, str(tmp_path)))
    proc = subprocess.run([PY, os.path.join(ROOT, "tools", "check_launch_script.py"), "--json", str(script)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert not report["accepted"] and "--bf16 needs CUDA" in report["error"]  # the first of its GPU-only flags
    hw = {r["flag"] for r in report["flags_detail"] if r["status"] == "hardware"}
    assert {"--bf16", "--fp8-format"} <= hw and "--transformer-impl" not in hw
    assert set(report["without_hardware_flags"]["flags"]) == hw and report["without_hardware_flags"]["accepted"]
    assert not hw & set(report["runnable_argv"]) and "--transformer-impl" in report["runnable_argv"]
    assert report["megatron_lm_flags_unrecognized"] == 0


def test_every_megatron_lm_flag_is_recognised():
    """Each flag of Megatron-LM's parser is defined here or placed in the treatment table:
    none can end as argparse's "unrecognized arguments"; each placed flag has a kind."""
    from megatron.training import compat
    from megatron.training.arguments import build_parser

    names = set(compat.megatron_lm_flags())
    assert len(names) > 600
    options = {s for a in build_parser(megatron_lm_flags=True)._actions for s in a.option_strings}
    assert not names - options
    kinds = {compat.treatment(f).kind for f in names if f not in compat.TABLE}
    assert kinds <= {"unsupported", "noop"}
    assert {t.kind for t in compat.TABLE.values()} == {"noop", "ignored", "hardware", "unsupported"}
    # each one that is not this driver's own flag has a reason of its own (no catch-all refusal)
    generic = [f for f in sorted(names - {s for a in build_parser()._actions for s in a.option_strings})
               if "not implemented by this driver (docs/usage.md" in compat.treatment(f).reason]
    assert not generic, generic


def test_fork_flags_are_refused_naming_the_fork():
    """Each training flag of MindSpeed, MindSpeed-LLM, FlagScale and Pai-Megatron-Patch that
    Megatron-LM lacks is registered (never "unrecognized") and refused with a reason that names
    its fork; none shadows a Megatron-LM flag. (tests/training/test_driver_bad_input.py runs a
    few through pretrain_gpt.py's parser: one line each.)"""
    from megatron.training import compat
    from megatron.training.arguments import build_parser

    forks = json.load(open(os.path.join(ROOT, "megatron", "training", "fork_flags.json")))["forks"]
    assert set(forks) == {"MindSpeed", "MindSpeed-LLM", "FlagScale", "Pai-Megatron-Patch"}
    options = {s for a in build_parser(megatron_lm_flags=True)._actions for s in a.option_strings}
    megatron = set(compat.megatron_lm_flags())
    for fork, entry in forks.items():
        assert len(entry["flags"]) > 40 and len(entry["commit"]) == 12, fork
        for flag in entry["flags"]:
            assert flag in options and flag not in megatron, flag
            t = compat.treatment(flag)
            assert t.kind == "unsupported" and f"a {compat.fork_flags()[flag]} flag, not Megatron-LM's" in t.reason
    assert "use --num-query-groups" in compat.treatment("--n-head-kv").reason


def test_each_megatron_lm_flag_parses_or_fails_in_one_line(corpus, capsys):
    """Every Megatron-LM flag alone (with a value "1" where it takes values): parsed, or one
    error line naming it; never a traceback, never "unrecognized arguments"."""
    from megatron.training import compat
    from megatron.training.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
            "--cpu", "--data-path", corpus]
    outcomes = {"parsed": 0, "refused": 0}
    for flag, nargs in sorted(compat.megatron_lm_flags().items()):
        values = [] if nargs == 0 else ["1"] * (int(nargs) if isinstance(nargs, int) else 1)
        try:
            parse_args([*base, flag, *values], world_size=1)
            outcomes["parsed"] += 1
        except SystemExit as e:
            lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
            assert e.code == 2 and len(lines) == 1, (flag, lines)
            assert "unrecognized arguments" not in lines[0], (flag, lines[0])
            assert flag in lines[0] or flag.replace("_", "-") in lines[0], (flag, lines[0])  # names it
            outcomes["refused"] += 1
    assert outcomes["parsed"] > 100 and outcomes["refused"] > 100, outcomes


def test_the_parser_is_built_once_and_a_preset_leaves_it_as_it_was(corpus):
    """parse_args reuses one parser per process (the sweep above parses ~950 command lines);
    a --model-preset's defaults hold for its own parse only: the next command line without a
    preset gets the flags' own defaults, and an explicit flag still wins over a preset."""
    from megatron.training import arguments as A

    base = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128", "--cpu",
            "--data-path", corpus]
    plain = A.parse_args(["--num-layers", "2", *base], world_size=1)
    cached = A._pretrain_parser()
    defaults = dict(cached._defaults), {a.dest: a.default for a in cached._actions}
    preset = A.parse_args(["--model-preset", "qwen2.5-0.5b", *base], world_size=1)
    assert preset.num_layers == 24 and preset.num_query_groups == 2 and preset.swiglu
    assert preset.hidden_size == 64  # explicit beats the preset
    assert A._pretrain_parser() is cached
    assert (dict(cached._defaults), {a.dest: a.default for a in cached._actions}) == defaults
    again = A.parse_args(["--num-layers", "2", *base], world_size=1)
    assert vars(again) == vars(plain)
    assert not again.swiglu and again.num_query_groups == plain.num_query_groups


def test_checkpoint_flags_of_continued_pretraining_are_honoured():
    """Issue 52's checkpoint flags are honoured by the config tool; the formats still refused
    and ModelOpt's flags (Megatron-LM's pretrain_gpt.py adds them with ModelOpt) say why."""
    from megatron.training.launch_check import classify

    rows = classify([("--ckpt-format", ["torch"]), ("--dist-ckpt-optim-fully-reshardable", []),
                     ("--distrib-optim-fully-reshardable-mem-efficient", []), ("--use-checkpoint-args", []),
                     ("--padded-vocab-size", ["50304"]), ("--save-interval", ["100"]), ("--no-save-optim", []),
                     ("--ckpt-format", ["fsdp_dtensor"]), ("--export-kd-cfg", ["kd.yaml"])], cuda=False, te=False)
    status = [r["status"] for r in rows]
    assert status == ["honoured"] * 7 + ["unsupported"] * 2, rows
    assert "ModelOpt" in rows[-1]["reason"] and "torch_dist" in rows[-2]["reason"]
    # Megatron FSDP's format is its own: honoured (written as torch_dist, one warning) only with it
    with_fsdp = classify([("--use-megatron-fsdp", []), ("--ckpt-format", ["fsdp_dtensor"])], cuda=False, te=False)
    assert [r["status"] for r in with_fsdp] == ["honoured", "honoured"], with_fsdp
