"""What ``pretrain_gpt.py`` does with each flag of a Megatron-LM launch script (no run).

:func:`script_flags` reads the flags out of a shell launch script (continuation lines
joined, comments dropped, ``torchrun``'s own flags skipped; values are the words after a
flag on its line, as many as the flag takes). :func:`classify` gives each one a status:

* ``honoured``: this driver implements it, or it is a documented no-op here
  (``compat.py``'s ``noop``: the effect is already this driver's behaviour);
* ``ignored``: accepted with a warning line (a logging / profiling extra not produced);
* ``hardware``: needs a GPU or a library this machine lacks (the driver stops with one
  line naming it); drop it to run here (classified for a CUDA target, the Megatron-LM flags
  this driver refuses on every GPU are ``unsupported``);
* ``unsupported``: refused with one line and the reason (MoE, MLA, a value not
  implemented, ...);
* ``unrecognized``: Megatron-LM has no such flag either (argparse's error).

Values that are shell variables (``$X``) cannot be checked and are taken as given.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.training.fp8 import FLAGS as FP8_FLAGS

LAUNCHER_FLAGS = {
    "--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank", "--master_addr",
    "--master-addr", "--master_port", "--master-port", "--rdzv_backend", "--rdzv-backend", "--rdzv_endpoint",
    "--rdzv-endpoint", "--rdzv_id", "--rdzv-id", "--standalone", "--max_restarts", "--max-restarts",
    "--log_dir", "--log-dir", "--redirects", "--tee", "--local-ranks-filter", "--local_ranks_filter",
    "--role", "--rdzv-conf", "--rdzv_conf", "--monitor-interval", "--monitor_interval", "--start-method",
    "--start_method", "--run-path", "--run_path", "--local-addr", "--local_addr", "--logs-specs", "--logs_specs",
}
"""torchrun / torch.distributed.launch flags that appear in the same scripts (not ours)."""
_STOP = {")", "(", "&&", "||", "|", ";", "&", "2>&1", ">", ">>"}


def script_flags(text: str, parser: Optional[argparse.ArgumentParser] = None) -> List[Tuple[str, List[str]]]:
    """``[(flag, values)]`` of every ``--flag`` in a launch script, in order (see module docstring)."""
    from megatron.training.arguments import build_parser

    nargs = _nargs(parser or build_parser(megatron_lm_flags=True))
    out: List[Tuple[str, List[str]]] = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote on this line: split on blanks
            words = line.split("#", 1)[0].split()
        i = 0
        while i < len(words):
            word = words[i]
            i += 1
            if not word.startswith("--") or word in ("--",):
                continue
            name, eq, val = word.partition("=")
            if name in LAUNCHER_FLAGS:
                continue
            values = [val] if eq else []
            want = nargs.get(name, "?")
            while not eq and i < len(words) and _takes_more(want, len(values)) and \
                    not words[i].startswith("--") and words[i] not in _STOP:
                values.append(words[i])
                i += 1
            out.append((name, values))
    return out


def _takes_more(want, have: int) -> bool:
    if want in ("*", "+"):
        return True
    if want == "?":
        return have < 1
    return have < (1 if want is None else int(want))


def _nargs(parser: argparse.ArgumentParser) -> Dict[str, object]:
    out = {}
    for a in parser._actions:
        n = 0 if a.nargs == 0 else a.nargs
        for s in a.option_strings:
            out[s] = n
    return out


def _is_var(values: Sequence[str]) -> bool:
    return any("$" in v for v in values)


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def classify(flags: Sequence[Tuple[str, List[str]]], cuda: bool = False, te: bool = False) -> List[dict]:
    """``{"flag", "values", "status", "reason"}`` for each ``(flag, values)`` (module docstring).

    ``cuda`` / ``te``: whether CUDA and Transformer Engine are present where the script runs.
    """
    from megatron.training import compat
    from megatron.training.arguments import build_parser

    parser = build_parser(megatron_lm_flags=True)
    known = {s: a for a in parser._actions for s in a.option_strings}
    given = {f: v for f, v in flags}
    tp = _number((given.get("--tensor-model-parallel-size") or ["1"])[0]) or 1
    out = []
    for flag, values in flags:
        action = known.get(flag)
        if action is None:
            status, reason = "unrecognized", "not a Megatron-LM flag either"
        elif action.dest.startswith(compat.DEST_PREFIX):
            t = compat.treatment(compat._spelling(flag), " ".join(values) if values else None)
            status = {"noop": "honoured"}.get(t.kind, t.kind)
            reason = t.reason
            if status == "hardware" and cuda:  # these the trainer refuses on every GPU too
                status, reason = "unsupported", f"refused on CUDA machines too: {reason}"
        else:
            status, reason = _own(flag, values, action, parser, cuda, te, tp, given)
        out.append({"flag": flag, "values": values, "status": status, "reason": reason})
    return out


def _own(flag: str, values: List[str], action, parser, cuda: bool, te: bool, tp: float,
         given: Dict[str, List[str]]) -> Tuple[str, str]:
    """Status of one of this driver's own flags, by its value (mirrors arguments.py's checks)."""
    v = values[0] if values else ""
    if (flag in ("--bf16", "--fp16") or (flag == "--distributed-backend" and v == "nccl")) and not cuda:
        return "hardware", "needs CUDA"
    if flag in FP8_FLAGS and "--fp8-format" in given:  # fp8.py: Transformer Engine's layers on a GPU
        te_spec = (given.get("--transformer-impl") or ["transformer_engine"])[0] == "transformer_engine"
        cp = _number((given.get("--context-parallel-size") or ["1"])[0]) or 1
        if not (cuda and te):
            return "hardware", "needs Transformer Engine's layers on a CUDA GPU"
        if not te_spec or cp > 1:
            return "unsupported", ("FP8 needs Transformer Engine's layer spec, which this driver builds only with "
                                   "--transformer-impl transformer_engine and without context parallelism")
    if flag == "--use-flash-attn":
        return "honoured", "no effect, as in Megatron-LM main (which reads it nowhere)"
    te_impl = (given.get("--transformer-impl") or ["transformer_engine"])[0] == "transformer_engine"
    if flag == "--attention-backend" and v in ("flash", "fused") and not (te_impl and cuda and te):
        return "ignored", "Transformer Engine's attention: the local layer spec runs this project's (one warning)"
    if flag == "--deterministic-mode" and cuda and ("--sparse-attention" in given or "--sparse-balance" in given):
        return "unsupported", "the sparse attention kernels are not deterministic on CUDA (atomic accumulation)"
    if flag == "--transformer-impl" and v == "transformer_engine" and not (cuda and te):
        return "honoured", "the local layer spec without CUDA and transformer_engine (one warning line)"
    if _is_var(values):
        return "honoured", "value is a shell variable (not checked)"
    rules = {
        "--transformer-impl": (v == "inference_optimized", "inference layers do not apply to training"),
        "--ckpt-format": (v not in ("", "torch_dist", "torch") and
                          not (v == "fsdp_dtensor" and "--use-megatron-fsdp" in given),
                          "torch_dist checkpoints are written; torch_dist and legacy torch ones are read"),
        "--attention-dropout": ((_number(v) or 0) > 0 and "--sparse-attention" in given,
                                "the sparse attention kernels apply no dropout"),
    }
    bad, why = rules.get(flag, (False, ""))
    if bad:
        return "unsupported", why
    if action.nargs != 0:
        try:
            _check_value(parser, flag, values)
        except ValueError as e:
            return "unsupported", str(e)
    return "honoured", "implemented" if not (flag == "--sequence-parallel" and tp == 1) else \
        "off with TP = 1, as in Megatron-LM"


def _check_value(parser, flag: str, values: List[str]) -> None:
    """argparse's type / choice check of one flag's values; ValueError with its message."""
    action = next(a for a in parser._actions if flag in a.option_strings)
    texts = values if isinstance(action.nargs, (str, int)) and action.nargs not in ("?",) else values[:1]
    for text in texts:
        if action.choices is not None and text not in action.choices:
            raise ValueError(f"invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
        if action.type is not None and not isinstance(action, argparse._StoreConstAction):
            try:
                action.type(text)
            except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
                raise ValueError(f"invalid value {text!r}: {e}") from None


def summarize(rows: List[dict]) -> dict:
    """Counts by status and the share of flags honoured among those not refused for hardware."""
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    considered = len(rows) - counts.get("hardware", 0)
    return {"flags": len(rows), "counts": counts,
            "honoured_fraction": counts.get("honoured", 0) / considered if considered else 1.0,
            "megatron_lm_flags_unrecognized": counts.get("unrecognized", 0)}


def runnable_argv(rows: List[dict]) -> List[str]:
    """The script's flags minus those refused for missing hardware (what runs here)."""
    argv: List[str] = []
    for r in rows:
        if r["status"] != "hardware":
            argv += [r["flag"], *r["values"]]
    return argv


def judge_line(argv: Sequence[str], cuda: bool, te: bool, world_size: int) -> Optional[str]:
    """The whole command line as ``pretrain_gpt.py``'s own parse and validation judge it on a
    machine with (or without) CUDA and Transformer Engine: None when it is accepted, else the
    one error line the trainer would print (files it names must exist, as for the trainer)."""
    import contextlib
    import io

    from megatron.training.arg_checks import assume_hardware
    from megatron.training.arguments import parse_args

    err = io.StringIO()
    with assume_hardware(cuda, te), contextlib.redirect_stderr(err):
        try:
            parse_args(list(argv), world_size=world_size)
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            return lines[-1] if lines else "refused"
    return None
