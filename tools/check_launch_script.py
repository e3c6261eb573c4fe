"""Which flags of a Megatron-LM launch script ``pretrain_gpt.py`` honours, before running it.

Reads a shell launch script written for Megatron-LM's ``pretrain_gpt.py`` (arrays,
continuation lines and torchrun flags are fine) and prints JSON: per flag its status
(``honoured``, ``ignored`` = accepted with a warning, ``hardware`` = needs a GPU/library
missing here, ``unsupported`` = refused with the reason, ``unrecognized`` = not a
Megatron-LM flag either), the counts, the share honoured (of the flags not refused for
hardware), and the command line that runs here (hardware-bound flags dropped)::

    .venv/bin/python tools/check_launch_script.py examples/llama/train_llama3_8b.sh
    .venv/bin/python tools/check_launch_script.py --cuda --te my_script.sh   # as on a GPU node with TE

Exit code 0 when every flag is honoured or ignored (after dropping hardware-bound ones),
1 when some flag is unsupported or unrecognized, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from megatron.training.arguments import OneLineParser, usage_error

    p = OneLineParser(prog="check_launch_script.py", description=__doc__.splitlines()[0])
    p.add_argument("script", help="the launch script (shell), or - for stdin")
    p.add_argument("--cuda", action="store_true", help="classify as on a machine with CUDA")
    p.add_argument("--te", action="store_true", help="classify as with Transformer Engine installed")
    a = p.parse_args(argv)
    try:
        text = sys.stdin.read() if a.script == "-" else open(a.script, encoding="utf-8").read()
    except OSError as e:
        usage_error(f"{a.script}: {e.strerror}", prog=p.prog)
    except UnicodeDecodeError as e:
        usage_error(f"{a.script}: not UTF-8 text ({e.reason} at byte {e.start})", prog=p.prog)
    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.launch_check import classify, runnable_argv, script_flags, summarize

    flags = script_flags(text)
    if not flags:
        usage_error(f"{a.script}: no --flags found", prog=p.prog)
    rows = classify(flags, cuda=a.cuda, te=a.te)
    report = dict(summarize(rows), script=a.script, runnable_argv=runnable_argv(rows), flags_detail=rows)
    print(json.dumps(report, indent=1))
    bad = report["counts"].get("unsupported", 0) + report["counts"].get("unrecognized", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
