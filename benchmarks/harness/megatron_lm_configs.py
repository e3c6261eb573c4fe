"""What ``pretrain_gpt.py`` does with the flags of Megatron-LM's GPT functional-test configs.

Reads every ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of a Megatron-LM
checkout and keeps the training cases (inference and RL cases are not ``pretrain_gpt.py``
launches). The headline is the share of WHOLE configs the trainer accepts: each config's
command line through ``pretrain_gpt.py``'s own parse and validation
(:func:`megatron.training.launch_check.judge_line`) as on this machine, or with ``--cuda`` as
on a GPU node with Transformer Engine, with the shell variables of its paths pointed at a
small indexed dataset and a scratch directory, on the world of 8 ranks the configs run on
(their model-parallel size where 8 is not a multiple of it); beside it the refusals by
reason. Then, flag by flag (:func:`megatron.training.launch_check.classify`): counts by
status, the share honoured among the uses not refused for hardware, per-config shares, and
the most frequent refusals. Prints JSON::

    git clone --depth 1 https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    .venv/bin/python -m benchmarks.harness.megatron_lm_configs --megatron-lm /tmp/Megatron-LM          # this machine
    .venv/bin/python -m benchmarks.harness.megatron_lm_configs --megatron-lm /tmp/Megatron-LM --cuda   # a GPU node
"""

from __future__ import annotations

import collections
import functools
import glob
import json
import os
import re
import shutil
import statistics
import sys

NOT_TRAINING = ("--prompts", "--temperature", "--incoming-requests-per-sec", "--perform-rl-step")
"""A config with one of these flags runs Megatron-LM's inference or RL entry point."""


def config_flags(model_args: dict) -> list:
    """``[(flag, values)]`` of a config's ``MODEL_ARGS`` (``true``: a switch; ``false``: absent;
    a value in square brackets loses them, as Megatron-LM's launcher ``_run_training.sh`` strips
    them: ``"[2 2]"`` is the two values 2 2)."""
    out = []
    for key, value in model_args.items():
        if not str(key).startswith("--") or value is False or value == "false":
            continue
        text = str(value).strip()
        if re.fullmatch(r"\[[^\]]+\]", text):
            text = text[1:-1]
        out.append((str(key), [] if value is True or value is None or value == "true" else text.split()))
    return out


def config_argv(flags: list, scratch: str, data_prefix: str) -> list:
    """The config's command line as its launcher writes it: a value of several words stays one
    argument where the flag takes one (``--step-batch-size-schedule "0:384 200B:768"``), and
    the shell variables made real: ``--data-path`` the small dataset at ``data_prefix``, a
    number ``1``, any other value a path under ``scratch``."""
    actions = _actions()
    argv = []
    for flag, values in flags:
        action = actions.get(flag)
        if any("$" in v for v in values):
            numeric = action is not None and action.type not in (None, str)
            values = [data_prefix] if flag == "--data-path" else ["1"] if numeric else \
                [os.path.join(scratch, re.sub(r"[${}]", "", v).strip("/")) for v in values]
        if action is not None and action.nargs is None and len(values) > 1:
            values = [" ".join(values)]
        if flag in TOKENIZER_FILES and values and values[0].startswith(scratch):
            _stand_in(flag, values[0])
        argv += [flag, *values]
    return argv


TOKENIZER_FILES = ("--vocab-file", "--merge-file")
"""Files a config names under its data directory that the trainer reads at launch: a tiny
stand-in is written where the real one would be (the cluster has it; this machine does not)."""


FIM_TOKENS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<|endoftext|>")
"""Megatron-LM's default FIM and end-of-document tokens: a FIM config's vocabulary has them."""


def _stand_in(flag: str, path: str) -> None:
    """A GPT-2 byte-level BPE file of the smallest valid kind at ``path`` (256 byte tokens and
    the FIM tokens, no merges)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if flag == "--vocab-file":
        from tokenizers.pre_tokenizers import ByteLevel

        tokens = sorted(ByteLevel.alphabet()) + list(FIM_TOKENS)
        text = json.dumps({tok: i for i, tok in enumerate(tokens)})
    else:
        text = "#version: 0.2\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@functools.cache
def _actions() -> dict:
    from megatron.training.arguments import build_parser

    return {s: a for a in build_parser(megatron_lm_flags=True)._actions for s in a.option_strings}


def world_size(flags: list) -> int:
    """The configs' node of 8 ranks: the model-parallel size times the largest data-parallel
    size that fits in 8 and divides the batch (a config of one micro-batch runs on its
    model-parallel ranks alone)."""
    given = dict(flags)

    def number(flag: str, default: int) -> int:
        try:
            return int((given.get(flag) or [str(default)])[0])
        except ValueError:  # a shell variable
            return default

    model = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        model *= number(flag, 1)
    mbs = number("--micro-batch-size", 1)
    batches = number("--global-batch-size", mbs * max(1, 8 // model)) // mbs
    dp = max((d for d in range(1, max(1, 8 // model) + 1) if batches % d == 0), default=1)
    return model * dp


def _dataset(scratch: str) -> str:
    """A small indexed dataset (the configs' data files are not here)."""
    import numpy as np

    from megatron.training.indexed_io import write_documents

    prefix = os.path.join(scratch, "data", "text_document")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    rng = np.random.default_rng(0)
    write_documents(prefix, (rng.integers(0, 255, size=n) for n in rng.integers(64, 512, size=200)), 256)
    return prefix


def measure(root: str, cuda: bool) -> dict:
    import tempfile

    import yaml

    from megatron.training.launch_check import classify, judge_line, summarize

    pattern = os.path.join(root, "tests", "functional_tests", "test_cases", "gpt", "*", "model_config.yaml")
    counts, shares, refused, unrecognized = collections.Counter(), [], collections.Counter(), collections.Counter()
    whole, whole_runnable, whole_refused, refused_feature = [], [], collections.Counter(), []
    files = sorted(glob.glob(pattern))
    scratch = tempfile.mkdtemp(prefix="megatron_lm_configs_")
    data_prefix = _dataset(scratch)
    for path in files:
        with open(path, encoding="utf-8") as f:
            model_args = (yaml.safe_load(f) or {}).get("MODEL_ARGS") or {}
        if not model_args or any(k in model_args for k in NOT_TRAINING):  # empty: no launch line
            continue
        flags = config_flags(model_args)
        rows = classify(flags, cuda=cuda, te=cuda)
        runnable = [(r["flag"], r["values"]) for r in rows if r["status"] != "hardware"]
        for kept, verdicts in ((flags, whole), (runnable, whole_runnable)):
            verdict = judge_line(config_argv(kept, scratch, data_prefix), cuda=cuda, te=cuda,
                                 world_size=world_size(flags))
            verdicts.append(verdict is None)
            if verdict is not None and kept is runnable:
                whole_refused[_reason(verdict)] += 1
                unsupported = {r["flag"] for r in rows if r["status"] == "unsupported"}
                refused_feature.append(verdict.split("error: ", 1)[-1].split(":")[0].split(" ")[0] in unsupported)
        shares.append(summarize(rows)["honoured_fraction"])
        for r in rows:
            counts[r["status"]] += 1
            if r["status"] == "unsupported":
                refused[f"{r['flag']}: {r['reason']}"] += 1
            elif r["status"] == "unrecognized":
                unrecognized[r["flag"]] += 1
    shutil.rmtree(scratch, ignore_errors=True)
    considered = sum(counts.values()) - counts["hardware"]
    return {"configs": len(files), "training_configs": len(shares), "cuda": cuda,
            "whole_configs_accepted": sum(whole),
            "whole_configs_accepted_fraction": round(sum(whole) / len(whole), 4) if whole else None,
            # what runs here: the line without the flags refused for missing hardware (--bf16 on CPU)
            "whole_configs_accepted_without_hardware_flags": sum(whole_runnable),
            "whole_configs_accepted_without_hardware_flags_fraction":
                round(sum(whole_runnable) / len(whole_runnable), 4) if whole_runnable else None,
            # refused naming a flag of a feature this driver does not implement (MoE, MLA, FSDP, ...)
            "whole_configs_refused_for_unsupported_feature": sum(refused_feature),
            "whole_configs_refused_by": whole_refused.most_common(),
            "counts": dict(counts),
            "honoured_fraction": round(counts["honoured"] / considered, 4) if considered else None,
            "per_config_median": round(statistics.median(shares), 4) if shares else None,
            "per_config_at_least_95": sum(s >= 0.95 for s in shares),
            "top_refused": refused.most_common(8), "unrecognized": unrecognized.most_common()}


def _reason(line: str) -> str:
    """A refusal line without its program name and numbers (configs refused alike group)."""
    text = line.split("error: ", 1)[-1]
    return re.sub(r"\d+(\.\d+)?", "N", text)[:160]


def main(argv=None) -> None:
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="megatron_lm_configs.py", description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, metavar="DIR", help="a Megatron-LM checkout")
    p.add_argument("--cuda", action="store_true", help="classify as on a GPU node with Transformer Engine")
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.megatron_lm, "tests", "functional_tests")):
        p.error(f"--megatron-lm {a.megatron_lm}: no tests/functional_tests there (not a Megatron-LM checkout)")
    print(json.dumps(measure(a.megatron_lm, a.cuda), indent=1))


if __name__ == "__main__":
    sys.exit(main())
