"""Worlds of warm rank processes for the tests: start-up paid once a session, not once a run.

Each worker process imports torch, megatron-core, megatron.training and sparsebalance
once (~5 s of CPU; a launch paid it for every rank of every run), then runs jobs: a
script run as ``torchrun --nproc-per-node N SCRIPT ARGS`` would run it on each rank
(``runpy`` as ``__main__``, ``sys.argv``, ``RANK`` / ``WORLD_SIZE`` / ``MASTER_PORT`` and
the job's environment), with its stdout and stderr in files. A job of N ranks runs on
workers 0..N-1; the script brings up ``torch.distributed`` and megatron-core's
``parallel_state`` as the driver does (``pretrain()`` -> ``initialize()``), on a fresh
port per job, and tears them down at its end as a process's exit would.

Between jobs each worker puts back what a job may change and a fresh process would
not carry over: environment, ``sys.path`` / ``sys.argv``, working directory, signal
handlers, torch's thread count, grad mode and default dtype, warning filters (and the
once-per-location registries), functions registered with ``atexit`` (run at the job's
end: e.g. the ``--save`` lock's release), process groups and parallel state left
initialised, and every global of the project's and megatron-core's modules and
attribute of their classes that the job rebound or whose list / dict / set it changed
in place (monkeypatching workers, lazily set globals, idempotent installers). Not put
back: torch's and other third-party modules' attributes (a script that patches those,
e.g. ``torch.save``, runs as a process). A job that fails, times out or kills its
process ends the whole world (all workers); the next job starts a fresh one.

What stays a separate process (``tests/training/conftest.py`` ``launch``): a
contract that is the process itself: exit codes and messages of command lines, killed
or hung ranks, the watchdog, signals from outside, fresh-interpreter imports.

:class:`World` is the tests' side (``world`` fixture, tests/conftest.py); ``python
tests/_world.py`` a worker.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time

from _warm_runner import _exit_code, redirect_output  # this file's directory is on sys.path (a script's, or conftest's)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCOPES = ("sparsebalance", "megatron", "pretrain_gpt")
"""Modules whose globals (and classes' attributes) are put back after every job."""
PRELOAD = ("megatron.training", "numpy", "torch", "megatron.core", "megatron.core.pipeline_parallel.schedules",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.models.gpt", "pretrain_gpt")
"""Imported at a worker's start, with every module of ``sparsebalance`` and ``megatron.training``
(``megatron.training`` first: megatron-core's fusion compiles are then deferred, see its ``__init__``)."""
FAILED_GRACE_S = 30
"""How long the other ranks of a job get to finish after one rank failed."""
OWN = ("sparsebalance", "megatron.training", "pretrain_gpt")
"""The project's modules (megatron-core's are never dropped: see :func:`_drop_new`)."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGALRM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- worker side


def _snapshot() -> list:
    """(namespace, copy of it, copies of its lists / dicts / sets, is a class) for every
    loaded module in :data:`SCOPES` and each class it defines."""
    saved = []

    def keep(owner, space, is_class):
        held = {k: (v, type(v)(v)) for k, v in space.items() if type(v) in (list, dict, set)}
        saved.append((owner, dict(space), held, is_class))

    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(SCOPES):
            continue
        space = vars(mod)
        keep(space, space, False)
        for value in list(space.values()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                keep(value, vars(value), True)
    return saved


def _same(now, before) -> bool:
    if len(now) != len(before):
        return False
    if isinstance(now, list):
        return all(a is b for a, b in zip(now, before))
    if isinstance(now, dict):
        return all(k in now and now[k] is v for k, v in before.items())
    return now == before


def _restore(saved: list) -> None:
    """Rebind what a job rebound, refill the lists, dicts and sets it changed in place (an
    idempotent patcher's record of what it patched goes with the patch), drop what it
    added (submodules excepted: a package keeps its submodule attributes, as the import
    system expects)."""
    for owner, before, held, is_class in saved:
        now = vars(owner) if is_class else owner
        for key in [k for k in now if k not in before]:
            if isinstance(now[key], type(sys)) or (key.startswith("__") and key.endswith("__")):
                continue
            if is_class:
                delattr(owner, key)
            else:
                del now[key]
        for key, value in before.items():
            if key not in now or now[key] is not value:
                if is_class:
                    if key in ("__dict__", "__weakref__"):
                        continue
                    setattr(owner, key, value)
                else:
                    now[key] = value
        for container, contents in held.values():
            if not _same(container, contents):
                container.clear()
                if isinstance(container, list):
                    container.extend(contents)
                else:
                    container.update(contents)


def _teardown_distributed() -> None:
    import torch
    from megatron.core import parallel_state as ps

    try:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_job(req: dict) -> int:
    import gc
    import runpy
    import traceback
    import warnings

    import torch

    torch_state = torch.get_num_threads(), torch.is_grad_enabled(), torch.get_default_dtype()
    env, path, argv, cwd = dict(os.environ), list(sys.path), list(sys.argv), os.getcwd()
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    filters = warnings.filters[:]
    saved, loaded = _snapshot(), set(sys.modules)
    exits, register = [], atexit.register
    atexit.register = lambda fn, *a, **k: (exits.append((fn, a, k)), fn)[1]
    sys.stdout.flush()
    sys.stderr.flush()
    fds = [os.dup(1), os.dup(2)]
    redirect_output(req["stdout"], req["stderr"])
    code = 0
    try:
        os.chdir(req["cwd"])
        os.environ.update(req["env"])
        script = os.path.abspath(req["script"])
        sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
        sys.argv = [script, *req["argv"]]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for fn, a, k in reversed(exits):  # what a process runs at its exit
            try:
                fn(*a, **k)
            except Exception:
                traceback.print_exc()
        try:
            _teardown_distributed()
        except Exception:
            traceback.print_exc()
            code = code or 1
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), fds):
            os.dup2(old, fd)
            os.close(old)
        atexit.register = register
        _restore(saved)
        _drop_new(loaded)
        for s, h in handlers.items():
            signal.signal(s, h)
        warnings.resetwarnings()  # also forgets which warnings were shown once
        warnings.filters[:] = filters
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv[:] = path, argv
        torch.set_num_threads(torch_state[0])
        torch.set_grad_enabled(torch_state[1])
        torch.set_default_dtype(torch_state[2])
        gc.collect()
    return code


def _preload() -> None:
    """Import what jobs use, every module of the project included: a module is put back
    after a job only if it was loaded before it (:func:`_drop_new`)."""
    import importlib
    import pkgutil
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
        for package in ("sparsebalance", "megatron.training"):
            path = importlib.import_module(package).__path__
            for info in pkgutil.walk_packages(path, package + "."):
                try:
                    importlib.import_module(info.name)
                except Exception:  # e.g. GPU-only modules: a job cannot import them either
                    pass
    from megatron.training.cpu_bridge import install_cpu_bridge

    install_cpu_bridge(force_cpu=True)  # idempotent: every job's initialize() finds it in place


def _drop_new(before: set) -> None:
    """Forget project modules first imported by a job (none after :func:`_preload`, unless
    a job adds one): the next job imports them afresh, as a new process would."""
    for name in [n for n in sys.modules if n not in before and n.startswith(OWN)]:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
            delattr(sys.modules[parent], child)


def main() -> None:
    sys.path.append(ROOT)  # for the preload; a job's sys.path[0] is its script's directory
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # stray output between jobs must not mix into the reply stream
        os.dup2(null, fd)
    _preload()
    base = list(sys.path)
    while True:
        try:
            req = pickle.load(requests)
        except EOFError:
            break
        sys.path[:] = base
        pickle.dump({"returncode": _run_job(req)}, replies)
        replies.flush()
    os._exit(0)  # no interpreter teardown (seconds with torch loaded)


# ----------------------------------------------------------------------------- tests' side


class Job:
    """A finished job: ``returncode`` (0 only if every rank's is 0, else the first non-zero
    one, as torchrun reports a failed world), ``stdout`` / ``stderr`` (the ranks' in rank
    order), ``ranks`` (per-rank ``(returncode, stdout, stderr)``)."""

    def __init__(self, args, ranks):
        self.args, self.ranks = args, ranks
        codes = [r[0] for r in ranks]
        self.returncode = next((c for c in codes if c), 0)
        self.stdout = "".join(r[1] for r in ranks)
        self.stderr = "".join(r[2] for r in ranks)


class World:
    """Warm rank processes; :meth:`launch` runs one job on the first ``nproc`` of them.

    ``env``: the workers' environment (the jobs' base environment); ``io_dir``: where
    the jobs' output files go. One job at a time."""

    def __init__(self, io_dir: str, env: dict):
        self.io_dir, self.env, self.procs, self.n = io_dir, dict(env), [], 0

    def _grow(self, size: int) -> None:
        while len(self.procs) < size:
            log = open(os.path.join(self.io_dir, f"worker{len(self.procs)}-{time.time():.0f}.log"), "w")
            self.procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=ROOT,
                                               env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=log))
            log.close()

    def launch(self, script: str, args, nproc: int = 1, timeout: float = 240, extra_env=None,
               cwd: str = ROOT) -> Job:
        """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` (``python SCRIPT ARGS`` for one
        rank) on warm workers; the job's environment is the workers' plus ``extra_env``.
        A job past ``timeout`` seconds ends the world and raises ``TimeoutExpired``."""
        if any(p.poll() is not None for p in self.procs):  # one died between jobs
            self.close(kill=True)
        self._grow(nproc)
        self.n += 1
        port = _free_port()
        files = []
        for rank in range(nproc):
            out, err = (os.path.join(self.io_dir, f"job{self.n}-rank{rank}.{s}") for s in ("out", "err"))
            files.append((out, err))
            env = dict(extra_env or {}, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            req = {"script": script, "argv": [str(a) for a in args], "env": env, "cwd": str(cwd),
                   "stdout": out, "stderr": err}
            try:
                pickle.dump(req, self.procs[rank].stdin)
                self.procs[rank].stdin.flush()
            except BrokenPipeError:
                self.close(kill=True)
                raise RuntimeError("a world worker had died; the world restarts at the next job") from None
        codes, deadline = {}, time.monotonic() + timeout
        pending = {self.procs[r].stdout.fileno(): r for r in range(nproc)}
        while pending:
            ready = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))[0]
            if not ready:
                if any(codes.values()):  # the others wait on the failed rank: end them
                    for rank in pending.values():
                        codes[rank] = 1
                    break
                self.close(kill=True)
                raise subprocess.TimeoutExpired([script, *args], timeout)
            for fd in ready:
                rank = pending.pop(fd)
                try:
                    codes[rank] = pickle.load(self.procs[rank].stdout)["returncode"]
                except EOFError:  # the worker died (e.g. SIGKILL): its exit status, as torchrun's
                    codes[rank] = self.procs[rank].wait() or 1
                if codes[rank]:
                    deadline = min(deadline, time.monotonic() + FAILED_GRACE_S)
        ranks = []
        for rank, (out, err) in enumerate(files):
            with open(out) as o, open(err) as e:
                ranks.append((codes[rank], o.read(), e.read()))
        job = Job([script, *args], ranks)
        if job.returncode:  # a failed job may leave ranks waiting on each other: start afresh
            self.close(kill=True)
        return job

    def close(self, kill: bool = False) -> None:
        """End the workers (``kill``: at once, e.g. ranks stuck in a failed job)."""
        for p in self.procs:
            if kill:
                p.kill()
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

if __name__ == "__main__":
    main()
