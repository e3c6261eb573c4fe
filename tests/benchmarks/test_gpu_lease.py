"""benchmarks/gpu_lease.sh (the evidence chain cut to one 15-minute GPU lease) and
benchmarks/gpu_fa4_install.sh (flash-attn-4 from two bundles), on the CPU: the plan's order and
time, and the installer's one-line refusals. The GPU runs themselves are in docs/gpu.md."""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sh(*args, env=None, cwd=REPO):
    return subprocess.run(["bash", *args], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


def test_dry_run_orders_by_value_and_fits_twelve_minutes():
    proc = _sh("benchmarks/gpu_lease.sh", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    steps = [line.split(":", 1)[0] for line in lines]
    assert steps == ["fa4tests", "fa4bench", "train", "tests", "profile"]
    budgets = {s: float(re.search(r"--budget-s (\d+)", line).group(1)) for s, line in zip(steps, lines)}
    # each command after the two-part install stays inside the 10-minute limit
    assert sum(budgets[s] for s in ("fa4tests", "fa4bench", "train")) <= 560
    assert sum(budgets[s] for s in ("tests", "profile")) <= 560
    assert "--test-modules test_fa4_gpu.py" in lines[0] and "--backends fa4" in lines[1]
    assert "--train-backend fa4" in lines[2] and "--train-seq-lens 65536" in lines[2]
    assert sum(budgets.values()) <= 12 * 60  # the whole chain within 12 minutes of GPU time


def test_unknown_step_is_one_line():
    proc = _sh("benchmarks/gpu_lease.sh", "--dry-run", env={"STEPS": "fa4tests nope"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["gpu_lease.sh: error: unknown step 'nope' (fa4tests fa4bench "
                                                "train train128k flexbench tests profile)"]


def test_train128k_is_its_own_step_with_its_own_budget():
    """128K training is not in the default plan (its arms need the loss in chunks, added by
    stages.py above 64K tokens); STEPS=train128k prints it, TRAIN128K_S sets its budget."""
    proc = _sh("benchmarks/gpu_lease.sh", "--dry-run", env={"STEPS": "train128k"})
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("train128k: bash benchmarks/gpu_check.sh ") and "--parts train " in line
    assert "--train-seq-lens 131072 " in line and "--budget-s 300 --part-budgets train=300" in line
    proc = _sh("benchmarks/gpu_lease.sh", "--dry-run", env={"STEPS": "train128k", "TRAIN128K_S": "420"})
    assert proc.stdout.strip().endswith("--budget-s 420 --part-budgets train=420")
    default = _sh("benchmarks/gpu_lease.sh", "--dry-run").stdout
    assert "train128k" not in default and "131072 --train-backend" not in default


def test_a_steps_budget_also_raises_its_parts_own_cap():
    """gpu_check.py caps each part (the profile at 150 s); Run 7's PROFILE_S=330 still cut the
    profile at 120 s (0.8 of that cap) until the step's budget raised the part's cap too."""
    proc = _sh("benchmarks/gpu_lease.sh", "--dry-run", env={"STEPS": "profile", "PROFILE_S": "330"})
    (line,) = proc.stdout.strip().splitlines()
    assert line.endswith("--parts profile --train-backend fa4 --budget-s 330 --part-budgets profile=330")
    from benchmarks import gpu_check as gc

    args = line.split("gpu_check.sh ", 1)[1].split()
    assert gc.parse_args([*args, "--dry-run"]).part_budgets["profile"] == 330.0


@pytest.mark.parametrize("args, said", [
    ((), "usage: gpu_fa4_install.sh stash|install"),
    (("stash",), ".gpu1/libs.part0 missing"),
    (("install",), "libs.part0 missing: run the stash command first"),
])
def test_installer_refuses_in_one_line(tmp_path, args, said):
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "gpu_fa4_install.sh").write_text(open(os.path.join(REPO, "benchmarks", "gpu_fa4_install.sh")).read())
    proc = _sh(str(tools / "gpu_fa4_install.sh"), *args, env={"STASH": str(tmp_path / "stash")}, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_fa4_install.sh: error: ") and said in lines[0]


def test_installer_assembles_checks_and_refuses_a_damaged_part(tmp_path):
    """Part 0 stashed by the first command, part 1 carried by the second: assembled, its
    sha256 checked, then pip (here a stand-in that records its arguments) installs it."""
    import hashlib

    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "gpu_fa4_install.sh").write_text(open(os.path.join(REPO, "benchmarks", "gpu_fa4_install.sh")).read())
    blob = os.urandom(3000)
    (tmp_path / ".gpu1").mkdir()
    (tmp_path / ".gpu1" / "libs.part0").write_bytes(blob[:1000])
    g2 = tmp_path / ".gpu2"
    g2.mkdir()
    (g2 / "libs.part1").write_bytes(blob[1000:])
    (g2 / "libs.name").write_text("libs-1.0-py3-none-any.whl\n")
    (g2 / "libs.sha256").write_text(hashlib.sha256(blob).hexdigest() + "\n")
    (g2 / "other-1.0-py3-none-any.whl").write_bytes(b"x")
    fake_py = tmp_path / "fakepy"
    fake_py.write_text("#!/usr/bin/env bash\necho \"$@\" > \"$(dirname \"$0\")/pip_args\"\n")
    fake_py.chmod(0o755)
    env = {"STASH": str(tmp_path / "stash"), "PY": str(fake_py), "SITE": str(tmp_path / "site")}
    assert _sh(str(tools / "gpu_fa4_install.sh"), "stash", env=env, cwd=tmp_path).returncode == 0
    proc = _sh(str(tools / "gpu_fa4_install.sh"), "install", env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    site = tmp_path / "site"
    # CuTeDSL's packages first on the path (pip --target does not run the wheel's .pth)
    assert proc.stdout.strip().splitlines()[-1].startswith(
        f"export PYTHONPATH={site}/nvidia_cutlass_dsl/dsl_packages:{site}")
    assert (tmp_path / "stash" / "libs-1.0-py3-none-any.whl").read_bytes() == blob
    pip_args = (tmp_path / "pip_args").read_text()
    assert "--no-index" in pip_args and "libs-1.0-py3-none-any.whl" in pip_args and "other-1.0" in pip_args
    (g2 / "libs.part1").write_bytes(blob[1000:-1] + b"?")  # damaged in transit
    proc = _sh(str(tools / "gpu_fa4_install.sh"), "install", env=env, cwd=tmp_path)
    assert proc.returncode == 1 and "wrong sha256" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
