"""Whether ``pretrain_gpt.py`` accepts a whole launch line, judged by its own parse and validation.

:func:`judge` runs :func:`megatron.training.arguments.parse_args` (argparse, then every
cross-flag rule of ``validate``: Megatron-LM's rules, the refusals, the hardware checks)
on the line, on a :class:`Target` machine: ``cuda`` / ``te`` stand for a CUDA device and
an importable ``transformer_engine`` (emulated while the parse runs: the trainer's own
probes answer as on the target). The verdict is the trainer's: accepted with its warning
lines, or refused with its one error line. Files the line names (dataset, tokenizer,
checkpoint) are checked where this runs, as the trainer checks them where it runs.

:func:`launch_line` turns a shell launch script into that line (:func:`launch_check.script_flags`)
and the world size torchrun gives it; :func:`expand_variables` first sets its variables as
the shell would.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Target:
    """The machine a line is judged for."""

    cuda: bool = False
    """Whether a CUDA device is present (``--bf16``, NCCL, Transformer Engine need one)."""
    te: bool = False
    """Whether the ``transformer_engine`` package imports there."""


@dataclass
class Verdict:
    """The trainer's answer to one launch line."""

    accepted: bool
    """Whether parse and validation pass (training would start)."""
    error: Optional[str] = None
    """The trainer's one error line (without ``pretrain_gpt.py: error:``) when refused."""
    warnings: List[str] = field(default_factory=list)
    """The warning lines the trainer prints for an accepted line."""
    trains_as: str = ""
    """One line: the model, parallel layout, layer implementation and attention that train."""


@contextlib.contextmanager
def on_target(target: Target) -> Iterator[None]:
    """The trainer's hardware probes answer as on ``target`` while the block runs."""
    from megatron.training.arg_checks import assume_hardware

    with assume_hardware(target.cuda, target.te):
        yield


def judge(argv: Sequence[str], world_size: int, target: Target) -> Verdict:
    """Parse and validate ``argv`` as ``pretrain_gpt.py`` would on ``world_size`` ranks of ``target``."""
    from megatron.training.arguments import parse_args

    stderr = io.StringIO()
    try:
        with on_target(target), contextlib.redirect_stderr(stderr):
            args = parse_args(list(argv), world_size=world_size)
    except SystemExit:
        lines = [ln for ln in stderr.getvalue().splitlines() if ln.strip()]
        last = lines[-1] if lines else "refused (no message)"
        return Verdict(False, error=re.sub(r"^[\w.]+: error: ", "", last))
    return Verdict(True, warnings=list(args.compat_warnings), trains_as=trains_as(args))


def trains_as(args) -> str:
    """One line describing what a validated ``args`` trains."""
    groups = f", {args.num_query_groups} KV groups" if args.num_query_groups else ""
    positions = args.position_embedding_type
    if positions == "yarn":
        positions += (f" (factor {args.rotary_scaling_factor:g} over an original "
                      f"{args.yarn_original_max_position_embeddings} tokens)")
    model = (f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads{groups}, "
             f"seq {args.seq_length}, {positions} positions")
    layout = (f"TP {args.tensor_model_parallel_size} PP {args.pipeline_model_parallel_size} "
              f"CP {args.context_parallel_size} DP {args.data_parallel_size}")
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if args.sparse_attention:
        attention = (f"sparse attention block {args.sb_block_size} top-k {args.sb_topk} "
                     f"({args.sb_attention_backend})")
        if args.sparse_balance:
            attention += ", SparseBalance"
    else:
        attention = f"dense attention ({args.attention_backend})"
    return f"{model}; {layout}; {args.transformer_impl} layers, {dtype}; {attention}"


_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(?!\()(\S*)\s*(?:#.*)?$")


def expand_variables(text: str, environ: Optional[dict] = None) -> Tuple[str, List[str]]:
    """``text`` with its variables replaced as the shell would, and the names left unset.

    Values come from the script's own plain assignments (``NAME=value``, ``export
    NAME=value``, in order) over ``environ`` (default: this process's environment);
    ``${NAME:-default}`` takes its default when NAME is unset. Arrays are left to
    :func:`launch_check.script_flags`, which reads their flags where they are written.
    """
    env = dict(os.environ if environ is None else environ)
    unset = set()

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(2) is not None:
            return m.group(2)
        unset.add(name)
        return m.group(0)

    out = []
    for line in text.splitlines(keepends=True):
        line = _REF.sub(one, line)
        m = _ASSIGN.match(line)
        if m:
            env[m.group(1)] = m.group(2).strip("\"'")
        out.append(line)
    return "".join(out), sorted(unset)


def launch_line(text: str) -> Tuple[List[str], Optional[int]]:
    """``(argv, world size or None)`` of a launch script (variables already expanded).

    The world size is torchrun's ``--nproc-per-node`` x ``--nnodes`` when both are numbers.
    """
    from megatron.training.launch_check import script_flags

    argv = [w for flag, values in script_flags(text) for w in (flag, *values)]
    return argv, _torchrun_world(text)


def _torchrun_world(text: str) -> Optional[int]:
    sizes = {}
    for name in ("nproc[-_]per[-_]node", "nnodes"):
        m = re.search(rf"--{name}[= ]+(\d+)\b(?!:)", text)
        sizes[name] = int(m.group(1)) if m else None
    if None in sizes.values():
        return None
    return sizes["nproc[-_]per[-_]node"] * sizes["nnodes"]


def smallest_world(argv: Sequence[str]) -> int:
    """TP x PP x CP of ``argv`` (1 each when absent or not a number): one data-parallel replica."""
    world = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        if flag in argv:
            i = list(argv).index(flag)
            value = argv[i + 1] if i + 1 < len(argv) else ""
            world *= int(value) if value.isdigit() and int(value) > 0 else 1
    return world
