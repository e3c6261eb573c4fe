#!/usr/bin/env python
"""Which repository files one training step runs, and where it enters the library.

Runs the exact-resume test's ``--sparse-balance`` configuration (PP=2 over gloo, 2
ranks, analytic cost model; benchmarks/ci/behaviour_hashes.py's flags) for 4 steps and
traces, on every rank and thread, the Python calls of step 3 (from the end of step 2's
bookkeeping to the end of step 3's: step 4's packing and its background plan included). Prints
one JSON object: the repository files the step ran (``driver``: megatron/training and
pretrain_gpt.py; ``library``: sparsebalance/), and the crossings into the library:
each distinct (caller function -> library function) call whose caller lies outside
sparsebalance/ (the driver, or megatron-core calling the attention module). A library
function torch's autograd engine runs in backward (a custom ``Function.backward``
whose forward the library called) is listed apart, under ``autograd_callbacks``,
with the call that started that backward: nobody outside the library calls it.
``--functions`` adds every repository function the step ran (``file:function``)::

    .venv/bin/python benchmarks/ci/step_route.py [--functions]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
TRACED_STEP = 3  # of 4: step 3 also builds step 4's packing and plans it ahead


def _rel(path: str) -> str:
    """``path`` relative to the repository, "megatron-core", or "" (anything else: torch,
    the standard library, generated code, this tool)."""
    if not os.path.isabs(path) or path == os.path.abspath(__file__):
        return ""
    if "site-packages" in path:
        return "megatron-core" if f"{os.sep}megatron{os.sep}core{os.sep}" in path else ""
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else ""


def _caller(frame) -> tuple:
    """(``file:function`` of the nearest caller in the repository or megatron-core, whether
    torch's autograd engine ran in between); torch's module call machinery and the
    standard library are looked through."""
    f, engine = frame.f_back, False
    while f is not None and not _rel(f.f_code.co_filename):
        engine = engine or f.f_code.co_name == "_engine_run_backward"
        f = f.f_back
    return ("" if f is None else f"{_rel(f.f_code.co_filename)}:{f.f_code.co_name}"), engine


def worker() -> None:
    """Inside torchrun: run pretrain_gpt.main() with step 3 traced; dump to $SB_ROUTE_OUT."""
    import threading

    from megatron.training import training

    files, edges, callbacks, funcs = set(), set(), set(), set()

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = _rel(frame.f_code.co_filename)
        if not callee or callee == "megatron-core":
            return
        files.add(callee)
        funcs.add(f"{callee}:{frame.f_code.co_name}")
        if callee.startswith("sparsebalance/"):
            caller, engine = _caller(frame)
            if caller and not caller.startswith("sparsebalance/"):
                (callbacks if engine else edges).add(f"{caller} -> {callee}:{frame.f_code.co_name}")

    def on_step(iteration, state, result):
        if iteration == TRACED_STEP - 1:
            threading.setprofile(prof)
            sys.setprofile(prof)
        elif iteration == TRACED_STEP:
            sys.setprofile(None)
            threading.setprofile(None)
            out = os.path.join(os.environ["SB_ROUTE_OUT"], f"rank{os.environ.get('RANK', '0')}.json")
            with open(out, "w") as f:
                json.dump({"files": sorted(files), "edges": sorted(edges),
                           "callbacks": sorted(callbacks), "functions": sorted(funcs)}, f)

    pretrain = training.pretrain
    training.pretrain = lambda args: pretrain(args, on_step=on_step)
    import pretrain_gpt

    sys.exit(pretrain_gpt.main())


def main() -> int:
    from benchmarks.ci.behaviour_hashes import PY, RUN_FLAGS, SPARSE_FLAGS, _env, _run
    from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

    with tempfile.TemporaryDirectory(prefix="step_route_") as tmp:
        corpus = os.path.join(tmp, "tiny")
        _run([PY, os.path.join(REPO, "tools", "make_corpus.py"), "--output-prefix", corpus,
              "--num-docs", "300", "--max-length", "384", "--quantile", "0.99"])
        flags = [f for f in SPARSE_FLAGS if f not in ("--train-iters", "5")]
        _run([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
              os.path.abspath(__file__), *PROJECT_RUN_FLAGS, *RUN_FLAGS, *flags, "--data-path", corpus,
              "--train-iters", str(TRACED_STEP + 1)],
             env={**_env(), "SB_ROUTE_OUT": tmp, "SB_ROUTE_WORKER": "1"})
        files, edges, callbacks, funcs = set(), set(), set(), set()
        for r in (0, 1):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                d = json.load(f)
            files.update(d["files"])
            edges.update(d["edges"])
            callbacks.update(d["callbacks"])
            funcs.update(d["functions"])
    driver = sorted(f for f in files if not f.startswith("sparsebalance/"))
    library = sorted(f for f in files if f.startswith("sparsebalance/"))
    out = {"files": len(files), "driver": driver, "library": library, "crossings": sorted(edges),
           "autograd_callbacks": sorted(callbacks)}
    if "--functions" in sys.argv[1:]:
        out["functions"] = sorted(funcs)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    if os.environ.get("SB_ROUTE_WORKER") == "1":
        worker()
    sys.exit(main())
