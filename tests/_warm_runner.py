"""A warm start for the bad-input tests: one process imports torch and megatron-core once,
then runs each command in a forked child, as ``python SCRIPT ARGS`` (or ``python -m
MODULE``) would: its own working directory, environment, argv, sys.path[0], stdout and
stderr, exit status. Start-up imports cost ~5 s of CPU a process on this project; a child
pays none. :class:`WarmRunner` is the tests' side (``python tests/_warm_runner.py`` the
server's).

What a fork cannot show is a script's own import-time output (the modules are already
imported): tests/integration/test_bad_input.py also runs each script cold, in a fresh
interpreter, and holds the runner to one (``test_warm_runner_behaves_like_python``).

Protocol: one JSON request a line on stdin
``{"script" | "module", "argv", "cwd", "env", "stdout", "stderr"}``; one reply a line on
stdout ``{"returncode": int}`` once the child has exited. The reply stream is a dup of the
original stdout, so children's output cannot mix into it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import subprocess
import sys
import traceback
import warnings

PRELOAD = ("megatron.training", "numpy", "torch", "megatron.core")


def _exit_code(code) -> int:
    """The status ``SystemExit(code)`` gives a Python process (a message goes to stderr, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def redirect_output(stdout: str, stderr: str) -> None:
    """Point file descriptors 1 and 2 at these files (created or truncated)."""
    for fd, path in ((1, stdout), (2, stderr)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _child(req: dict) -> None:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    redirect_output(req["stdout"], req["stderr"])
    sys.stdin = open(os.devnull)
    code = 0
    try:
        if "module" in req:
            # python -m: sys.path[0] is the working directory; PYTHONPATH entries follow.
            extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
            sys.path[:1] = [os.getcwd(), *extra]
            sys.argv = [req["module"], *req["argv"]]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))
            sys.argv = [req["script"], *req["argv"]]
            runpy.run_path(req["script"], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class WarmRunner:
    """The tests' side: a server process; :meth:`run` takes a command line as
    ``subprocess.run`` would and returns its ``CompletedProcess``. One command at a time."""

    def __init__(self, io_dir: str, env: dict, timeout_s: float = 120.0):
        self.io_dir, self.n, self.timeout_s = io_dir, 0, timeout_s
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=io_dir)

    def run(self, cmd: list[str], cwd: str, env: dict) -> subprocess.CompletedProcess:
        """``cmd``: ``[python, SCRIPT, *args]`` or ``[python, "-m", MODULE, *args]``."""
        target = {"module": cmd[2]} if cmd[1] == "-m" else {"script": cmd[1]}
        self.n += 1
        out, err = (os.path.join(self.io_dir, f"{self.proc.pid}-{self.n}.{s}") for s in ("out", "err"))
        req = dict(target, argv=cmd[3:] if "module" in target else cmd[2:], cwd=str(cwd), env=env,
                   stdout=out, stderr=err)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], self.timeout_s)[0]:
            self.proc.kill()
            raise subprocess.TimeoutExpired(cmd, self.timeout_s)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm runner died (exit {self.proc.wait()})")
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(cmd, json.loads(line)["returncode"], o.read(), e.read())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    pristine = warnings.filters[:]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.append(root)  # for megatron.training only: each child sets its own sys.path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            __import__(name)
    sys.path.remove(root)
    warnings.filters[:] = pristine
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(req)
            finally:
                os._exit(70)  # only reached if setting the child up failed
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()
    os._exit(0)  # stdin closed: no interpreter teardown (seconds with torch loaded)


if __name__ == "__main__":
    main()
