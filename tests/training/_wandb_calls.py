"""Run a script as ``__main__`` with the real wandb's ``Run.log`` recording its calls.

Usage: ``python _wandb_calls.py SCRIPT ARGS...``; each ``Run.log(data,
step=...)`` appends ``{"step": ..., "data": ...}`` as one JSON line to ``$SB_TEST_WANDB_CALLS``
and then logs as usual. Why: wandb offers no reader of an offline run's ``.wandb`` file
(its Python one was removed; only ``wandb sync`` / the Go core read it), so the tests
compare what the driver handed to wandb with what it logged, and check the offline run's
files exist.
"""

import json
import os
import runpy
import sys

from wandb.sdk.wandb_run import Run

_real_log = Run.log


def _recording_log(self, data, step=None, *args, **kwargs):
    with open(os.environ["SB_TEST_WANDB_CALLS"], "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "data": data}) + "\n")
    return _real_log(self, data, step, *args, **kwargs)


if __name__ == "__main__":
    Run.log = _recording_log
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
