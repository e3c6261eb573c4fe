"""What every gpu-check part shares: the repository root, the outcome of a part, and the
runner that starts a tool from the repository root (tests swap :func:`run` for a fake)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass, field
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclass
class Part:
    """The outcome of one part."""

    name: str
    passed: bool = False
    seconds: float = 0.0
    detail: str = ""
    """One line: what was checked, or why it failed."""
    data: dict = field(default_factory=dict)
    skipped: bool = False
    """Not run, and allowed not to be (optional parts)."""

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("pass" if self.passed else "fail")

    def as_dict(self) -> dict:
        return {**asdict(self), "status": self.status}


def run(cmd: List[str], timeout: float, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root; a timeout is returned as exit code 124."""
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f} s")


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or "").strip().splitlines() or (proc.stdout or "").strip().splitlines()
    return lines[-1][:300] if lines else f"exit code {proc.returncode}"
