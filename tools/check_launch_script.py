"""Whether pretrain_gpt.py accepts a Megatron-LM launch script, judged by its own parse and validation.

Reads a shell launch script written for Megatron-LM's ``pretrain_gpt.py`` (arrays,
continuation lines and torchrun flags are fine; ``$VARS`` expand from the script's own
assignments and the environment),
runs the trainer's own argument parsing and validation on the whole line, as on the
target machine (``--cuda``: a CUDA device; ``--te``: Transformer Engine installed; neither:
a CPU machine without TE, wherever the tool runs), and
prints the trainer's verdict::

    ACCEPTED on CUDA + Transformer Engine, 16 rank(s): trains 24 layers, hidden 2048, ...; 0 warnings
    REFUSED on CUDA + Transformer Engine, 4 rank(s): --fp8-format: needs Transformer Engine with FP8 ...

plus the flags refused on the target. ``--json`` prints the full report: the verdict and,
per flag, its status (``honoured``, ``ignored`` = accepted with a warning, ``hardware`` =
needs a GPU/library the target lacks, ``unsupported`` = refused with the reason,
``unrecognized`` = not a Megatron-LM flag either), the counts and the share honoured::

    .venv/bin/python tools/check_launch_script.py examples/llama/train_llama3_8b.sh
    .venv/bin/python tools/check_launch_script.py --cuda --te my_script.sh   # as on a GPU node with TE

Exit code 0 when the trainer accepts the line on the target, 1 when it refuses it, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parser():
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="check_launch_script.py", description=__doc__.splitlines()[0])
    p.add_argument("script", help="the launch script (shell), or - for stdin")
    p.add_argument("--cuda", action="store_true", help="judge as on a machine with a CUDA device")
    p.add_argument("--te", action="store_true", help="judge as with Transformer Engine installed")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks the line runs on (default: torchrun's --nproc-per-node x --nnodes in the "
                        "script, else TP x PP x CP)")
    p.add_argument("--json", action="store_true", help="print the full report (verdict and every flag) as JSON")
    return p


def _read(path: str, prog: str) -> str:
    from megatron.training.arguments import usage_error

    try:
        return sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as e:
        usage_error(f"{path}: {e.strerror}", prog=prog)
    except UnicodeDecodeError as e:
        usage_error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})", prog=prog)


def report(text: str, cuda: bool, te: bool, world_size=None) -> dict:
    """The verdict on the script's whole line and the per-flag table (what ``--json`` prints)."""
    from megatron.training.launch_check import classify, runnable_argv, script_flags, summarize
    from megatron.training.launch_verdict import Target, expand_variables, judge, launch_line, smallest_world

    text, unset = expand_variables(text)
    argv, torchrun_world = launch_line(text)
    world = world_size or torchrun_world or smallest_world(argv)
    target = Target(cuda=cuda, te=te)
    verdict = judge(argv, world, target)
    rows = classify(script_flags(text), cuda=cuda, te=te)
    out = dict(summarize(rows), accepted=verdict.accepted, error=verdict.error, warnings=verdict.warnings,
               trains_as=verdict.trains_as, world_size=world, target=vars(target), unset_variables=unset)
    hardware = [r["flag"] for r in rows if r["status"] == "hardware"]
    if not verdict.accepted and hardware:  # would it train here with those dropped?
        out["without_hardware_flags"] = dict(flags=hardware, accepted=judge(runnable_argv(rows), world,
                                                                           target).accepted)
    out.update(runnable_argv=runnable_argv(rows), flags_detail=rows)
    return out


def plain(r: dict) -> str:
    """The short verdict: one line, then the flags refused on the target and what helps."""
    where = "CUDA" if r["target"]["cuda"] else "CPU"
    where += " + Transformer Engine" if r["target"]["te"] else ""
    n = len(r["warnings"])
    if r["accepted"]:
        lines = [f"ACCEPTED on {where}, {r['world_size']} rank(s): trains {r['trains_as']}; "
                 f"{n} warning{'s' * (n != 1)}"]
        lines += [f"  warning: {w}" for w in r["warnings"]]
    else:
        lines = [f"REFUSED on {where}, {r['world_size']} rank(s): {r['error']}"]
    refused = [x for x in r["flags_detail"] if x["status"] in ("hardware", "unsupported", "unrecognized")]
    if refused:
        lines.append(f"flags refused on this target ({len(refused)}):")
        lines += [f"  {x['flag']}: {x['status']}: {x['reason']}" for x in refused]
    if "without_hardware_flags" in r:
        w = r["without_hardware_flags"]
        lines.append(f"without {' '.join(w['flags'])}: {'ACCEPTED' if w['accepted'] else 'still REFUSED'}")
    if r["unset_variables"]:
        lines.append("shell variables not set here (export them to check their values): "
                     + " ".join("$" + v for v in r["unset_variables"]))
    lines.append(f"{r['counts'].get('honoured', 0)} of {r['flags']} flags honoured; --json for the table")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    text = _read(a.script, p.prog)
    from megatron.training import quiet_optional_extras
    from megatron.training.arguments import usage_error
    from megatron.training.launch_check import script_flags

    quiet_optional_extras()
    if not script_flags(text):
        usage_error(f"{a.script}: no --flags found", prog=p.prog)
    r = dict(report(text, a.cuda, a.te, a.world_size), script=a.script)
    print(json.dumps(r, indent=1) if a.json else plain(r))
    return 0 if r["accepted"] else 1


if __name__ == "__main__":
    sys.exit(main())
