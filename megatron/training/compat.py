"""Megatron-LM's full flag set: what ``pretrain_gpt.py`` does with each flag it does not implement.

A Megatron-LM launch script must run unchanged or stop with ONE line saying why; a bare
"unrecognized arguments" is left for flags Megatron-LM does not have either. The names
(and how many values each takes) are data, in ``megatron_lm_flags.json`` (read from
Megatron-LM's own parser; see its ``source`` field: to refresh it, build the parser of a
Megatron-LM checkout, ``add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))``
(main needs Python >= 3.12, or ``typing.override`` shimmed on 3.11), and list each option
string with its nargs, 0 for the store_true/false/const ones). Every Megatron-LM flag that
:func:`megatron.training.arguments.build_parser` does not define itself is registered
by :func:`add_megatron_lm_flags` under a private dest and treated by :func:`treatment`:

* ``noop``: accepted; its effect is already what this driver does, or it only tunes
  performance of a path that does not exist here (fusions, buckets, workers). Honoured.
* ``ignored``: accepted with one warning line: a logging/profiling extra this driver
  does not produce. Results are unaffected.
* ``hardware``: needs a GPU / library this process lacks: one line naming what it needs.
* ``unsupported``: a family this driver does not train (MoE, MLA, Mamba, vision, RL,
  inference, ...) or an option not implemented: one line with the reason.

A flag given with its neutral value (``NEUTRAL``, e.g. ``--expert-model-parallel-size 1``)
is honoured whatever its family.

Flags of Megatron-LM's forks (MindSpeed, MindSpeed-LLM, FlagScale, Pai-Megatron-Patch; names
in ``fork_flags.json``) are registered too and refused in one line that names the fork and,
where this driver has one, the flag to use instead.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.training.compat_table import (
    FAMILIES,
    FORK_INSTEAD,
    HARDWARE,
    IGNORED,
    NEUTRAL,
    NOOP,
    NOOP_FAMILIES,
    REFUSED,
)

DEST_PREFIX = "mlm__"
"""argparse dest prefix of the flags registered from the table (never read elsewhere)."""


@dataclass(frozen=True)
class Treatment:
    """How ``pretrain_gpt.py`` treats one Megatron-LM flag it does not define."""

    kind: str
    """``noop``, ``ignored``, ``hardware`` or ``unsupported``."""
    reason: str
    """Why (one clause, shown to the user)."""


def _table() -> Dict[str, Treatment]:
    out: Dict[str, Treatment] = {}
    for kind, groups in (("noop", NOOP), ("ignored", IGNORED), ("hardware", HARDWARE),
                         ("unsupported", REFUSED)):
        for reason, names in groups.items():
            for name in names.split():
                out[name] = Treatment(kind, reason)
    return out


TABLE = _table()
"""Explicitly placed flags -> treatment (families and the default are in :func:`treatment`)."""


def _data(name: str) -> dict:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def megatron_lm_flags() -> Dict[str, object]:
    """Megatron-LM's flags -> argparse nargs (0: switch; None: one value; '*', '+', or a count)."""
    return _data("megatron_lm_flags.json")["flags"]


@functools.lru_cache(maxsize=None)
def fork_flags() -> Dict[str, str]:
    """Flags of Megatron-LM's forks that Megatron-LM lacks -> the fork's name."""
    out: Dict[str, str] = {}
    for fork, entry in _data("fork_flags.json")["forks"].items():
        for flag in entry["flags"]:
            out.setdefault(flag, fork)
    return out




def _fork_reason(flag: str, fork: str) -> str:
    instead = next((use for name, use in FORK_INSTEAD if flag == name or
                    (name.endswith("-") and flag.startswith(name))), None)
    tail = f"use {instead}" if instead else "drop it (tools/check_launch_script.py lists what each flag does here)"
    return f"a {fork} flag, not Megatron-LM's: this driver does not implement it; {tail}"


def treatment(flag: str, value: Optional[str] = None) -> Treatment:
    """How a Megatron-LM (or fork) flag this driver does not define is treated (module docstring)."""
    if flag in NEUTRAL and value is not None and _same_number(value, NEUTRAL[flag]):
        return Treatment("noop", "its value turns the feature off")
    if flag in TABLE:
        return TABLE[flag]
    fork = fork_flags().get(flag)
    if fork is not None and flag not in megatron_lm_flags():
        return Treatment("unsupported", _fork_reason(flag, fork))
    for prefix, reason in NOOP_FAMILIES:
        if flag.startswith(prefix):
            return Treatment("noop", reason)
    for prefix, reason in FAMILIES:
        if flag.startswith(prefix):
            return Treatment("unsupported", reason)
    return Treatment("unsupported", "not implemented by this driver (docs/usage.md lists what is)")


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def _registered() -> Dict[str, object]:
    """Every flag :func:`add_megatron_lm_flags` registers -> nargs (a fork's flags take any
    number of values: their own parsers are not read here, and each is refused anyway)."""
    out: Dict[str, object] = dict(megatron_lm_flags())
    for flag in fork_flags():
        out.setdefault(flag, "*")
    return out


def _dest(flag: str) -> str:
    return DEST_PREFIX + flag[2:].replace("-", "_")


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every Megatron-LM (and known fork) flag ``parser`` lacks (hidden from
    ``--help``), so that :func:`resolve` can name its treatment instead of argparse saying
    "unrecognized"."""
    known = {s for a in parser._actions for s in a.option_strings}
    dests = {a.dest for a in parser._actions}
    for flag, nargs in _registered().items():
        if flag in known:
            continue
        dest = _dest(flag)
        if dest in dests:  # another spelling of a registered flag (``_`` vs ``-``)
            action = next(a for a in parser._actions if a.dest == dest)
            action.option_strings.append(flag)
            parser._option_string_actions[flag] = action
            continue
        dests.add(dest)
        if nargs == 0:
            parser.add_argument(flag, dest=dest, action="store_const", const=True, default=None,
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, dest=dest, nargs=nargs, default=None, help=argparse.SUPPRESS,
                                **({"const": True} if nargs == "?" else {}))


def given_foreign(args: argparse.Namespace) -> List[Tuple[str, Optional[str]]]:
    """``(flag, value text)`` of each table-registered flag present in ``args``, in name order."""
    names = {}
    for flag in _registered():
        names.setdefault(_dest(flag), flag)
    out = []
    for dest, value in sorted(vars(args).items()):
        if dest.startswith(DEST_PREFIX) and value is not None:
            flag = names.get(dest) or "--" + dest[len(DEST_PREFIX):].replace("_", "-")
            text = None if value is True else " ".join(map(str, value)) if isinstance(value, list) else str(value)
            out.append((flag, text))
    return out


def _spelling(flag: str) -> str:
    """The table's spelling of ``flag`` (Megatron-LM mixes ``_`` and ``-`` in a few names)."""
    names = _registered()
    if flag in names:
        return flag
    alt = [n for n in names if n.replace("_", "-") == flag.replace("_", "-")]
    return alt[0] if alt else flag


def resolve(args: argparse.Namespace) -> List[str]:
    """Check the Megatron-LM flags given that this driver does not define.

    Returns the warning lines for ``ignored`` flags (one line for all of them); raises
    ``ValueError`` (one line) for the first ``hardware`` or ``unsupported`` flag.
    """
    ignored = []
    for flag, value in given_foreign(args):
        t = treatment(flag, value)
        if t.kind == "ignored":
            ignored.append(flag)
        elif t.kind in ("hardware", "unsupported"):
            raise ValueError(f"{flag}: {t.reason}")
    if not ignored:
        return []
    return [f"accepted without effect: {' '.join(ignored)} ({treatment(ignored[0]).reason})"
            if len({treatment(f).reason for f in ignored}) == 1 else
            f"accepted without effect (logging/profiling extras this driver does not produce): {' '.join(ignored)}"]


def check_hardware(args: argparse.Namespace, cuda: bool) -> List[str]:
    """Hardware-bound flags this driver defines: fine where the GPU / library is present,
    else ``ValueError`` with one line naming the flag and what it needs. Returns warning
    lines: ``--transformer-impl transformer_engine`` (Megatron-LM's default) that cannot run
    here becomes the local spec, said once."""
    from megatron.training import fp8

    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16)):
        if on and not cuda:
            raise ValueError(f"{flag} needs CUDA (the CPU path trains in fp32; drop {flag} or "
                             "run on a GPU without --cpu)")
    if args.distributed_backend == "nccl" and not cuda:
        raise ValueError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    warnings = []
    sparse = args.sparse_attention or args.sparse_balance
    if sparse and args.attention_backend in ("flash", "fused"):
        # this project's module fills the core-attention slot of either spec
        warnings.append(f"--attention-backend {args.attention_backend} chooses Transformer Engine's dense "
                        "attention; with sparse attention this project's module runs instead "
                        "(--sb-attention-backend picks its kernel)")
        args.attention_backend = "auto"
    if args.transformer_impl == "transformer_engine":
        why = _te_unusable(args, cuda)
        if why and getattr(args, "fp8_format", None):  # FP8 GEMMs are TE's (fp8.py)
            raise ValueError(fp8.hardware_refusal(args, why))
        if why:
            args.transformer_impl = "local"
            warnings.append(f"--transformer-impl transformer_engine: {why}; training with the local layer spec "
                            "(the same model and checkpoint layout without TE's fused LayerNorm-linear, linear "
                            "and attention kernels)")
    elif getattr(args, "fp8_format", None):
        raise ValueError(fp8.hardware_refusal(args))
    # Megatron-LM's local spec ignores --attention-backend too
    if args.attention_backend in ("flash", "fused") and args.transformer_impl == "local":
        warnings.append(f"--attention-backend {args.attention_backend} picks a Transformer Engine kernel; the "
                        "local layer spec runs this project's dense attention")
    if args.deterministic_mode and cuda and sparse:
        raise ValueError("--deterministic-mode on CUDA with --sparse-attention: the sparse attention kernels are "
                         "not deterministic (their backward accumulates with atomics); drop one, or train with --cpu")
    return warnings


def _te_unusable(args: argparse.Namespace, cuda: bool) -> Optional[str]:
    """Why Transformer Engine's layer spec cannot build this run (None: it can). With sparse
    attention the TE spec carries this project's module in its core-attention slot."""
    from megatron.training.arg_checks import has_transformer_engine

    missing = [x for x, ok in (("CUDA", cuda), ("the transformer_engine package", has_transformer_engine()))
               if not ok]
    if missing:
        return " and ".join(missing) + " missing"
    if args.context_parallel_size > 1:
        return "this driver's context-parallel attention lives in the local spec"
    return None


def split_script_flags(tokens: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """``[(flag, values)]`` of a launch command's arguments: values are the tokens after a
    flag up to the next ``--`` token (how a shell-split Megatron-LM command reads)."""
    out: List[Tuple[str, List[str]]] = []
    for tok in tokens:
        if tok.startswith("--"):
            name, eq, val = tok.partition("=")
            out.append((name, [val] if eq else []))
        elif out:
            out[-1][1].append(tok)
    return out
