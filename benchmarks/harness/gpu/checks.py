"""gpu-check's environment parts: ``deps`` (the offline wheels import), ``build`` (the CUDA
extension for this GPU) and ``tests`` (every CUDA test module in its own pytest, with
junit and ``-v`` summaries)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from typing import List

from benchmarks.harness.gpu import proc as gpu_proc
from benchmarks.harness.gpu.proc import Part

SKIP_WHEELS = ("torch-", "triton-", "nvidia_", "nvidia-")
"""Wheels never installed over the machine's own CUDA stack."""


def part_deps(a, left: float) -> Part:
    """The offline install happened in gpu_check.sh (PYTHONPATH=/tmp/site); here: the
    wheels it had and whether the stack imports."""
    wheels = sorted(os.path.basename(w) for w in glob.glob(os.path.join(a.wheels, "*.whl"))
                    if not os.path.basename(w).lower().startswith(SKIP_WHEELS))
    proc = gpu_proc.run([sys.executable, "-c", "import megatron.core, torch, triton; "
                 "print(megatron.core.__version__, torch.__version__, triton.__version__)"], left)
    ok = proc.returncode == 0
    fa4 = gpu_proc.run([sys.executable, "-c", "import flash_attn.cute, cutlass; print(cutlass.__version__)"], left)
    fa4_said = (f"cutlass-dsl {fa4.stdout.strip()}" if fa4.returncode == 0
                else "not importable: " + gpu_proc.last_line(fa4))
    detail = (f"megatron-core, torch, triton: {proc.stdout.strip()}; flash-attn-4: {fa4_said}" if ok else
              "import failed: " + gpu_proc.last_line(proc) + f" (run `make gpu-prep` on a connected "
              f"machine and carry {os.path.relpath(a.wheels, gpu_proc.REPO)}/)")
    return Part("deps", ok, detail=detail, data={"wheels": wheels, "fa4": fa4_said,
                                                 "pythonpath": os.environ.get("PYTHONPATH", "")})


def part_build(a, left: float) -> Part:
    """setup.py build_ext for this GPU's architecture; the CUDA kernels must load after."""
    if a.dry_run:  # the CPU machine's extension is already built (`make build`)
        probe = gpu_proc.run([sys.executable, "-c", "from sparsebalance.ops import HAS_CPU_EXT; "
                      "import sys; sys.exit(0 if HAS_CPU_EXT else 1)"], left)
        return Part("build", probe.returncode == 0, detail="dry run: the CPU extension imports"
                    if probe.returncode == 0 else "dry run: no CPU extension (run make build)")
    import torch
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}.{minor}"
    if cpp_extension.CUDA_HOME is None or not (shutil.which("nvcc") or os.path.isfile(
            os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))):
        return Part("build", False, detail="nvcc not found (no CUDA toolkit): the cuda backend "
                    "cannot be built; flex and triton need no build", data={"arch": arch})
    proc = gpu_proc.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], left,
                env={"TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(os.cpu_count() or 4)})
    if proc.returncode != 0:
        return Part("build", False, detail=gpu_proc.last_line(proc), data={"arch": arch})
    probe = gpu_proc.run([sys.executable, "-c", "from sparsebalance.ops import HAS_CUDA_EXT; "
                  "import sys; sys.exit(0 if HAS_CUDA_EXT else 1)"], 60)
    if probe.returncode != 0:
        return Part("build", False, detail="built, but sparsebalance.ops has no CUDA kernels",
                    data={"arch": arch})
    return Part("build", True, detail=f"sm_{major}{minor}", data={"arch": arch})


TEST_MODULES_FIRST = ("test_fa4_gpu.py", "test_route_gpu.py", "test_flex_gpu.py", "test_gpu_backends.py")
"""CUDA test modules run first, in this order (the kernels' correctness); the others
(the measured ``auto``, which times every backend) follow alphabetically."""


def cuda_test_modules() -> List[str]:
    """Test modules that need CUDA: the GPU backends test and every module that skips
    itself without CUDA (``torch.cuda.is_available()`` at module level), in run order
    (:data:`TEST_MODULES_FIRST` first)."""
    out = []
    for path in sorted(glob.glob(os.path.join(gpu_proc.REPO, "tests", "**", "test_*.py"), recursive=True)):
        with open(path) as fh:
            text = fh.read()
        if "allow_module_level=True" in text and "cuda.is_available()" in text:
            out.append(os.path.relpath(path, gpu_proc.REPO))
    rank = lambda m: (TEST_MODULES_FIRST.index(os.path.basename(m)) if os.path.basename(m) in TEST_MODULES_FIRST
                      else len(TEST_MODULES_FIRST), m)
    return sorted(out, key=rank)


def junit_summary(path: str, module: str = "?") -> dict:
    """Per-module counts and the failed test ids of a pytest junit XML file (``module``
    names the entries without a class name, such as a module's own skip)."""
    if not os.path.isfile(path):
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return {}
    mods, failed, why = {}, [], {}
    for case in root.iter("testcase"):
        mod = case.get("classname") or module  # module (or module.Class)
        m = mods.setdefault(mod, {"passed": 0, "failed": 0, "skipped": 0})
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            m["failed"] += 1
            failed.append(f"{case.get('classname')}::{case.get('name')}")
            # the assertion's own line, so a report read after the lease says why (Run 6's
            # report named its failed tests only, and the machine was gone)
            why[failed[-1]] = failure_line(bad.get("message") or bad.text or "")
        elif case.find("skipped") is not None:
            m["skipped"] += 1
        else:
            m["passed"] += 1
    return {"by_module": mods, "failed_tests": failed, "failures": why}


def failure_line(message: str, limit: int = 300) -> str:
    """A junit failure message cut to its first non-blank line, at most ``limit`` characters."""
    line = next((x.strip() for x in message.splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


_VERBOSE_RESULT = re.compile(r"^(\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
"""One finished test in ``pytest -v`` output: path, test id, result."""


def stdout_summary(text: str, module: str) -> dict:
    """:func:`junit_summary`'s shape from ``pytest -v`` output (one ``path::test RESULT``
    line per finished test), for a module killed before pytest wrote its junit file: the
    tests that finished before the cut still count."""
    mods, failed = {}, []
    for line in (text or "").splitlines():
        m = _VERBOSE_RESULT.match(line.strip())
        if not m:
            continue
        path, name, result = m.groups()
        key = path[:-3].replace("/", ".") if path.endswith(".py") else module
        counts = mods.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
        if result in ("FAILED", "ERROR"):
            counts["failed"] += 1
            failed.append(f"{key}::{name}")
        elif result in ("SKIPPED", "XFAIL"):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"by_module": mods, "failed_tests": failed} if mods else {}


def part_tests(a, left: float) -> Part:
    """Each CUDA test module in its own pytest (a module that hangs or runs out of time
    does not hide the others' results); a module may use what is left of the part's time
    but 45 s for each module after it."""
    mods = cuda_test_modules()
    only = getattr(a, "test_modules", None)
    if only:
        mods = [m for m in mods if os.path.basename(m) in only]
    if not mods:
        return Part("tests", False, detail="no CUDA test module found under tests/"
                    + (f" named {','.join(only)}" if only else ""))
    os.makedirs(a.work, exist_ok=True)
    t0, by_module, failed_tests, failures, lines, ok = time.time(), {}, [], {}, [], True
    for i, mod in enumerate(mods):
        # all that is left but a 45 s reserve for each module still to come
        cap = max(left - (time.time() - t0) - 45.0 * (len(mods) - 1 - i), 10.0)
        junit = os.path.join(a.work, f"gpu_tests_{i}.xml")
        if os.path.exists(junit):
            os.unlink(junit)
        # Correctness, not speed: one Triton launch config, no autotuning over every test shape.
        # -v: one line per finished test, so a module cut at its cap still reports those
        proc = gpu_proc.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                     f"--junitxml={junit}", mod], cap, env={"SPARSEBALANCE_TRITON_AUTOTUNE": "0"})
        got = junit_summary(junit, mod) or stdout_summary(proc.stdout, mod)
        by_module.update(got.get("by_module", {}))
        failed_tests += got.get("failed_tests", [])
        failures.update(got.get("failures", {}))
        tail = (proc.stdout or "").strip().splitlines()
        said = tail[-1].strip("= ") if tail and proc.returncode != 124 else gpu_proc.last_line(proc)
        if proc.returncode == 124:
            done = got.get("by_module", {}).values()
            said += (f" ({sum(m['passed'] for m in done)} passed, {sum(m['failed'] for m in done)} failed "
                     f"before the cut)")
        lines.append(f"{os.path.basename(mod)}: {said}")
        mod_ok = proc.returncode == 0 or (getattr(a, "dry_run", False) and proc.returncode == 5)
        ok &= mod_ok  # exit 5 (nothing collected: every module skips itself) only in a dry run
    counts = {k: sum(m[k] for m in by_module.values()) for k in ("passed", "failed", "skipped")}
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if getattr(a, "dry_run", False):
        summary = f"dry run (CUDA modules skip on the CPU): {summary}"
    return Part("tests", ok, detail=summary, data={"modules": mods, "by_module": by_module,
                                                   "failed_tests": failed_tests, "failures": failures,
                                                   "per_module": lines})
