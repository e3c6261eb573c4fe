"""The harness's launches, as real processes or forked from a warm one.

The experiment scripts start the driver and the tools as separate processes: ``torchrun
--nproc-per-node N pretrain_gpt.py ...`` per run, ``python tools/X.py ...`` for the
corpus and the profile. Each such process imports torch and megatron-core first, ~4 s of
CPU here, which is most of what a smoke run of a harness costs (the held-out-loss smoke
test started 24 processes for ~2 s of training each).

:func:`popen` takes what ``subprocess.Popen`` takes and, by default, is it. With
``SB_HARNESS_LAUNCH=fork`` in the environment (the test suite sets it for its harness
runs) a command of the form ``[python, SCRIPT, *args]`` or ``[python, -m,
torch.distributed.run, <flags>, SCRIPT, *args]`` runs in processes forked from a server
that has imported torch, megatron-core and the project once:

- ``python SCRIPT``: one process, as the interpreter would run it (``runpy`` as
  ``__main__``, ``sys.argv``, ``sys.path[0]``, working directory, environment, stdout /
  stderr on the files given, exit status);
- torchrun: an agent process (its own session if asked) whose children are the N ranks,
  with torchrun's per-rank environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``, a free port for ``--standalone``); the agent exits 0
  when every rank did, otherwise it ends the others (SIGTERM, then SIGKILL) and exits 1,
  as torchrun does. With ``--redirects 3 --log-dir D`` each rank writes
  ``D/fork/attempt_0/<rank>/{stdout,stderr}.log`` (torchrun's layout, another run id).

Process ids, process groups, signals (the held-out harness sends SIGUSR1 to the ranks it
finds under the agent), exit statuses and kills behave as for the real processes. What a
fork cannot show is a script's import-time output, and every forked process starts from
the server's interpreter state: modules already imported, the same hash seed. A command
of another form, or one whose environment differs from the server's in a variable read
at import (:data:`IMPORT_TIME_VARS`), starts as a real process.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRELOAD = ("megatron.training", "numpy", "torch", "megatron.core", "megatron.core.pipeline_parallel.schedules",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.models.gpt")
"""Imported once by the server (``megatron.training`` first: see its ``__init__``), then
every module of ``sparsebalance`` and ``megatron.training``."""
IMPORT_TIME_VARS = ("TRITON_INTERPRET", "PYTHONPATH", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES", "SB_HARNESS_LAUNCH")
"""Read when a module is imported: a job that sets them otherwise than the server runs cold."""
TERM_GRACE_S = 30.0
"""How long the agent gives the other ranks after one failed, before SIGKILL."""
_SERVER = None
_SERVER_LOCK = threading.Lock()
_BASE_PATH: List[str] = []
"""The server's ``sys.path`` without its own entries (the repository, its working directory)."""


# ----------------------------------------------------------------------------- commands


def parse(cmd: List[str]) -> Optional[dict]:
    """``{"script", "args", "nproc", "torchrun": {...}}`` of a command this module can fork,
    else None (``-m MODULE``, unknown torchrun flags, multi-node)."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or os.path.basename(cmd[0]).split(".")[0] not in ("python", "python3"):
        return None
    if cmd[1] != "-m":
        return None if cmd[1].startswith("-") else {"script": cmd[1], "args": cmd[2:], "nproc": 1, "torchrun": None}
    if len(cmd) < 4 or cmd[2] not in ("torch.distributed.run", "torch.distributed.launch"):
        return None
    run = {"standalone": False, "master_port": None, "master_addr": "127.0.0.1", "log_dir": None, "redirects": "0"}
    nproc, rest = 1, cmd[3:]
    valued = {"--nproc-per-node": "nproc", "--nproc_per_node": "nproc", "--master-port": "master_port",
              "--master_port": "master_port", "--master-addr": "master_addr", "--master_addr": "master_addr",
              "--log-dir": "log_dir", "--log_dir": "log_dir", "--redirects": "redirects", "--nnodes": "nnodes"}
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        flag, _, value = rest[i].partition("=")
        if flag == "--standalone":
            run["standalone"] = True
            i += 1
            continue
        if flag not in valued:
            return None
        if not value:
            if i + 1 >= len(rest):
                return None
            value, i = rest[i + 1], i + 1
        i += 1
        key = valued[flag]
        if key == "nproc":
            if not value.isdigit() or int(value) < 1:
                return None
            nproc = int(value)
        elif key == "nnodes":
            if value not in ("1", "1:1"):
                return None
        else:
            run[key] = value
    if i >= len(rest) or run["redirects"] not in ("0", "3"):
        return None
    if run["standalone"] and not any(f.split("=")[0] in ("--master-addr", "--master_addr") for f in rest[:i]):
        run["master_addr"] = "localhost"  # torchrun --standalone's rendezvous host
    return {"script": rest[i], "args": rest[i + 1:], "nproc": nproc, "torchrun": run}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_envs(env: dict, nproc: int, run: dict) -> List[dict]:
    """Each rank's environment, as torchrun sets it for one node."""
    port = run["master_port"] or str(_free_port())
    out = []
    for rank in range(nproc):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                 GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc),
                 ROLE_NAME="default", MASTER_ADDR=run["master_addr"], MASTER_PORT=port,
                 TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="fork")
        if nproc > 1 and "OMP_NUM_THREADS" not in env:
            e["OMP_NUM_THREADS"] = "1"  # torchrun's default for more than one process a node
        out.append(e)
    return out


# ----------------------------------------------------------------------------- server side


def _run_script(script: str, args: List[str], env: dict, cwd: str) -> None:
    """Become ``python SCRIPT ARGS`` with ``env`` in ``cwd``; never returns."""
    code = 0
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        import torch

        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # read by OpenMP when torch was imported
            torch.set_num_threads(int(threads))
        sys.stdin = open(os.devnull)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *_BASE_PATH]
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        c = e.code
        if c is None:
            code = 0
        elif isinstance(c, int):
            code = c & 0xFF
        else:
            print(c, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _redirect(out_fd: int, err_fd: int) -> None:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)


def _agent(job: dict) -> None:
    """The forked process of one command: the script itself, or torchrun's agent."""
    nproc, run = job["nproc"], job["torchrun"]
    if run is None:
        _run_script(job["script"], job["args"], job["env"], job["cwd"])
    envs, ranks = rank_envs(job["env"], nproc, run), {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            if run["redirects"] == "3" and run["log_dir"]:
                d = os.path.join(run["log_dir"], "fork", "attempt_0", str(rank))
                os.makedirs(d, exist_ok=True)
                fds = [os.open(os.path.join(d, f"{s}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                       for s in ("stdout", "stderr")]
                _redirect(*fds)
            _run_script(job["script"], job["args"], envs[rank], job["cwd"])
        ranks[pid] = rank

    def forward(sig, frame):  # torchrun passes SIGTERM / SIGINT on to its workers, then exits
        for p in ranks:
            _kill(p, sig)
        os._exit(128 + sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed, deadline = False, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for p in ranks:
                    _kill(p, signal.SIGKILL)
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue
        del ranks[pid]
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, deadline = True, time.monotonic() + TERM_GRACE_S
            for p in ranks:
                _kill(p, signal.SIGTERM)
    os._exit(1 if failed else 0)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def serve(sock: socket.socket) -> None:
    """Fork one agent per request; report each agent's pid, then its exit status."""
    agents = set()  # running agents' pids
    buf = b""
    while True:
        ready = select.select([sock], [], [], 0.05)[0]
        while agents:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in agents:
                _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
                agents.discard(pid)
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        if not msg:
            os._exit(0)  # the harness is gone: no interpreter teardown (seconds with torch loaded)
        buf += msg
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            job = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    sock.close()
                    if job["new_session"]:
                        os.setsid()
                    if job["ignore_usr1"]:
                        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
                    _redirect(*fds)
                    for fd in fds:
                        os.close(fd)
                    _agent(job)
                finally:
                    os._exit(70)  # only reached if setting the job up failed
            for fd in fds:
                os.close(fd)
            agents.add(pid)
            _send(sock, {"started": pid, "id": job["id"]})


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall((json.dumps(msg) + "\n").encode())


def main() -> None:
    import warnings

    sock = socket.socket(fileno=int(sys.argv[1]))
    _BASE_PATH[:] = [p for p in sys.path if p not in ("", ROOT, os.getcwd())]
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
        for package in ("sparsebalance", "megatron.training"):
            for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
                try:
                    importlib.import_module(info.name)
                except Exception:  # e.g. GPU-only modules: a job cannot import them either
                    pass
    serve(sock)


# ----------------------------------------------------------------------------- harness side


class _Server:
    def __init__(self):
        self.env = dict(os.environ)
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.harness.forklaunch", str(theirs.fileno())],
                                     cwd=ROOT, env=dict(self.env, PYTHONPATH=ROOT), pass_fds=[theirs.fileno()],
                                     stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock, self.buf, self.started, self.exited, self.n = ours, b"", {}, {}, 0
        self.lock = threading.Lock()  # a harness may launch from threads (fault_trials runs pairs)
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (it exits when its socket closes) and reap it."""
        self.sock.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self, timeout: float) -> None:
        if not select.select([self.sock], [], [], timeout)[0]:
            return
        data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError(f"the fork server ended (exit {self.proc.wait()})")
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "started" in msg:
                self.started[msg["id"]] = msg["started"]
            else:
                self.exited[msg["exited"]] = msg["returncode"]

    def start(self, job: dict, fds: List[int]) -> int:
        with self.lock:
            self.n += 1
            n = self.n
            socket.send_fds(self.sock, [(json.dumps(dict(job, id=n)) + "\n").encode()], fds)
            while n not in self.started:
                self._read(1.0)
            return self.started.pop(n)

    def returncode(self, pid: int, timeout: float = 0.0) -> Optional[int]:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if pid in self.exited:
                    return self.exited[pid]
                self._read(0.0 if deadline <= time.monotonic() else 0.05)
                if pid in self.exited:
                    return self.exited[pid]
            if time.monotonic() >= deadline:
                return None


class ForkedProcess:
    """What the harness uses of ``subprocess.Popen`` for a forked command."""

    def __init__(self, server: _Server, pid: int, args: list):
        self.server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = self.server.returncode(self.pid, 0.5 if left is None else min(left, 0.5))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            _kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _fd(f, inherited: int) -> int:
    if f is None:
        return inherited
    return f if isinstance(f, int) else f.fileno()


def popen(cmd: List[str], *, stdout=None, stderr=None, env: Optional[dict] = None, cwd: Optional[str] = None,
          start_new_session: bool = False, ignore_usr1: bool = False):
    """``subprocess.Popen(cmd, ...)`` (``ignore_usr1``: the process starts with SIGUSR1
    ignored), or the same command forked from the warm server (see the module's doc)."""
    env = dict(os.environ if env is None else env)
    def is_file(f) -> bool:  # None (inherited), a descriptor or a file object; not PIPE / DEVNULL
        return f is None or isinstance(f, int) and f >= 0 or hasattr(f, "fileno")

    files_ok = is_file(stdout) and (is_file(stderr) or stderr is subprocess.STDOUT)
    job = parse(cmd) if os.environ.get("SB_HARNESS_LAUNCH") == "fork" and files_ok else None
    global _SERVER
    with _SERVER_LOCK:
        if job is not None and _SERVER is None:
            _SERVER = _Server()
    if job is None or any(env.get(k) != _SERVER.env.get(k) for k in IMPORT_TIME_VARS):
        preexec = (lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN)) if ignore_usr1 else None
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=cwd, preexec_fn=preexec,
                                start_new_session=start_new_session)
    job.update(env=env, cwd=os.path.abspath(cwd or os.getcwd()), new_session=start_new_session,
               ignore_usr1=ignore_usr1)
    out = _fd(stdout, 1)
    err = out if stderr is subprocess.STDOUT else _fd(stderr, 2)
    pid = _SERVER.start(job, [out, err])
    return ForkedProcess(_SERVER, pid, list(cmd))


def run(cmd: List[str], *, cwd: Optional[str] = None, env: Optional[dict] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` through :func:`popen`:
    on a timeout the process is killed and ``TimeoutExpired`` raised with its output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            out.seek(0)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read()) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


if __name__ == "__main__":
    main()
