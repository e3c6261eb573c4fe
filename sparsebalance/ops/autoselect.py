"""``backend="auto"`` on CUDA: the fastest backend that passed verification on this device.

For a key (device name, head dim, block size, dtype) every available candidate
(:data:`CANDIDATES`) is first verified against the reference on a small ragged GQA batch,
forward and backward (error against an fp32 reference at most twice the reference's own
error at the dtype, the GPU tests' criterion, and the same kept-pair count), then timed on
one fixed shape (:data:`MEASURE_SHAPE`, fwd+bwd, routing included). The fastest verified
one wins. The choice, the reason and the timings are cached in a JSON file
(:func:`cache_path`, written atomically) and in the process, so a key is measured once
per machine. ``SPARSEBALANCE_AUTO_MEASURE=0`` skips the measurement and keeps the rule
of :func:`~sparsebalance.ops.backends.rule_backend` (triton > cuda). CPU tensors keep
that rule too (cpu > reference), so CPU results never depend on a measurement.

The driver logs and records :func:`auto_choice`'s dict:
``{"backend", "reason", "timings_ms", "failed", "key", "source"}``.

Layering: this module sits between the registry (:mod:`~sparsebalance.ops.backends`, whose
backends it verifies and times directly) and :mod:`~sparsebalance.ops.interface` (whose
:func:`resolve_backend` call it answers); it imports nothing above it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Dict, Optional, Tuple

import torch

from sparsebalance.ops import backends
from sparsebalance.ops.backends import is_available, kept_density, rule_backend, run_backend
from sparsebalance.ops.plan import routing_rule
from sparsebalance.pairs import density as exact_density

CANDIDATES = ("fa4", "flex", "triton", "cuda")
"""Backends ``auto`` may pick on CUDA."""
MEASURE_SHAPE = {"tokens": 16384, "heads": 16, "kv_heads": 2, "density": 0.12, "reps": 3}
"""The timed case: one document of 16K tokens, GQA 16:2, top-k for ~12% density."""
_memo: Dict[object, dict] = {}
"""Choices of this process, by cache key and by (device, head dim, block, dtype, name)."""


def cache_path() -> str:
    """``$SPARSEBALANCE_CACHE_DIR`` or ``$XDG_CACHE_HOME/sparsebalance`` (default
    ``~/.cache/sparsebalance``), file ``auto_backend.json``."""
    d = os.environ.get("SPARSEBALANCE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "sparsebalance")
    return os.path.join(d, "auto_backend.json")


def cache_key(device_name: str, head_dim: int, block_size: int, dtype: torch.dtype) -> str:
    """One line per measured configuration, e.g. ``NVIDIA H200|d128|b128|bfloat16``."""
    return f"{device_name}|d{int(head_dim)}|b{int(block_size)}|{str(dtype).replace('torch.', '')}"


def choose(candidates, verify: Callable[[str], Tuple[bool, str]],
           measure: Callable[[str], float]) -> dict:
    """The pure decision: verify each candidate, time those that pass, pick the fastest.

    ``verify(name) -> (ok, why)``; ``measure(name) -> ms``. An exception in either fails
    that candidate only. Returns ``{"backend", "reason", "timings_ms", "failed"}``;
    ``backend`` is None when no candidate passed.
    """
    timings, failed = {}, {}
    for name in candidates:
        try:
            ok, why = verify(name)
            if not ok:
                failed[name] = f"verification: {why}"
                continue
            timings[name] = float(measure(name))
        except Exception as e:  # a backend that cannot compile or run here is just not picked
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    if not timings:
        return {"backend": None, "reason": "no candidate passed: " + "; ".join(
            f"{n}: {w}" for n, w in failed.items()), "timings_ms": {}, "failed": failed}
    best = min(timings, key=timings.get)
    ranked = ", ".join(f"{n} {t:.2f} ms" for n, t in sorted(timings.items(), key=lambda x: x[1]))
    reason = f"fastest verified fwd+bwd: {ranked}"
    if failed:
        reason += "; not verified: " + ", ".join(sorted(failed))
    return {"backend": best, "reason": reason, "timings_ms": timings, "failed": failed}


def _read_cache(path: str) -> dict:
    try:
        with open(path) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # absent or damaged: measure again and rewrite
        return {}


def _write_cache(path: str, key: str, entry: dict) -> None:
    from sparsebalance.io import atomic_write_text

    data = _read_cache(path)
    data[key] = entry
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def _attend(q, k, v, cu, topk, block_size, name):
    """``sparse_attention(..., backend=name)`` for a named backend on checked inputs:
    ``(out, density)`` (the interface is above this module)."""
    with routing_rule(None):
        out, kept = run_backend(rule_backend(name, q.device), q, k, v, cu, topk, block_size)
    return out, kept_density(kept, cu, q.shape[1])


def _verify_on(device, head_dim, block_size, dtype) -> Callable[[str], Tuple[bool, str]]:
    g = torch.Generator().manual_seed(0)
    lens = [3 * block_size + 5, block_size // 2 + 1, 6 * block_size]
    T = sum(lens)
    mk = lambda h: torch.randn(T, h, head_dim, generator=g).to(torch.bfloat16).float()
    q, k, v, dout = mk(4), mk(2), mk(2), mk(4)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)

    def run(name, xs, dev):
        xs = [x.to(dev, dtype if name != "truth" else torch.float32).requires_grad_() for x in xs]
        out, dens = _attend(*xs, cu, 2, block_size, "reference" if name == "truth" else name)
        grads = torch.autograd.grad(out, xs, dout.to(dev, out.dtype))
        return [t.detach().float().cpu() for t in (out, *grads)], dens

    truth, dens_ref = run("truth", (q, k, v), "cpu")
    ref, _ = run("reference", (q, k, v), "cpu")

    def verify(name):
        got, dens = run(name, (q, k, v), device)
        if dens != dens_ref:
            return False, f"density {dens} != reference {dens_ref}"
        for what, t, r, x in zip(("out", "dq", "dk", "dv"), truth, ref, got):
            err, ref_err = (x - t).abs().max().item(), (r - t).abs().max().item()
            if not err <= 2 * ref_err + 1e-5:
                return False, f"{what} error {err:.3g} > 2 x reference's {ref_err:.3g}"
        return True, "ok"

    return verify


def _measure_on(device, head_dim, block_size, dtype) -> Callable[[str], float]:
    s = MEASURE_SHAPE
    T = s["tokens"]
    topk = min(range(T // block_size), key=lambda t: abs(exact_density([T], t, block_size) - s["density"]))
    g = torch.Generator(device=device).manual_seed(0)  # own generator: the job's RNG is untouched
    mk = lambda h: torch.randn(T, h, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
    q, k, v = mk(s["heads"]), mk(s["kv_heads"]), mk(s["kv_heads"])
    cu = torch.tensor([0, T], dtype=torch.int32)

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def measure(name):
        times = []
        for i in range(s["reps"] + 1):  # the first run compiles / autotunes
            sync()
            t0 = time.perf_counter()
            out, _ = _attend(q, k, v, cu, topk, block_size, name)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            sync()
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return measure


def auto_choice(device: torch.device, head_dim: int, block_size: int, dtype: torch.dtype, *,
                path: Optional[str] = None, verify: Optional[Callable] = None,
                measure: Optional[Callable] = None, device_name: Optional[str] = None) -> dict:
    """The backend ``auto`` runs for this configuration, with why.

    Returns ``{"backend", "reason", "timings_ms", "failed", "key", "source"}``; ``source``
    is ``rule`` (CPU, or measurement off), ``measured`` (just now), ``cache`` (the JSON
    file) or ``memo`` (this process). ``verify`` / ``measure`` / ``device_name`` replace
    the real ones (tests).
    """
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("SPARSEBALANCE_AUTO_MEASURE") == "0":
        why = ("CPU tensors: first available of cpu, reference" if device.type != "cuda" else
               "SPARSEBALANCE_AUTO_MEASURE=0: first available of triton, cuda")
        return {"backend": rule_backend("auto", device), "reason": why, "timings_ms": {},
                "failed": {}, "key": None, "source": "rule"}
    fast = (str(device), int(head_dim), int(block_size), dtype, device_name)
    if fast in _memo:  # every attention call of a training step lands here
        return dict(_memo[fast], source="memo")
    name = device_name or torch.cuda.get_device_name(device)
    key = cache_key(name, head_dim, block_size, dtype)
    if key in _memo:
        _memo[fast] = _memo[key]
        return dict(_memo[key], source="memo")
    path = path or cache_path()
    entry = _read_cache(path).get(key)
    source = "cache"
    if not (isinstance(entry, dict) and entry.get("backend") in CANDIDATES):
        cands = [n for n in CANDIDATES if is_available(n, device)]
        with torch.enable_grad():  # the first call may come from a no_grad forward (eval)
            entry = choose(cands, verify or _verify_on(device, head_dim, block_size, dtype),
                           measure or _measure_on(device, head_dim, block_size, dtype))
        source = "measured"
        if entry["backend"] is None:  # nothing verified: fall back to the rule, say so
            entry["backend"] = rule_backend("auto", device)
            entry["reason"] = f"rule fallback ({entry['reason']})"
        else:
            _write_cache(path, key, entry)
    _memo[key] = _memo[fast] = dict(entry, key=key)
    return dict(_memo[key], source=source)


def backend_choice(name: str, device: torch.device, head_dim: int, block_size: int,
                   dtype: torch.dtype) -> dict:
    """What the driver logs and records for ``--sb-attention-backend name``: the backend
    that will run and why (``auto``: :func:`auto_choice`, or the test override; a name:
    itself, checked usable). Raises ValueError for an unknown or unusable name."""
    device = torch.device(device)
    if name != "auto" or backends.overridden() is not None:
        got = rule_backend(name, device)
        why = f"--sb-attention-backend {name}" if name != "auto" else "override_backend (tests)"
        return {"backend": got, "reason": why, "timings_ms": {}, "failed": {}, "key": None,
                "source": "flag"}
    return auto_choice(device, head_dim, block_size, dtype)


def resolve_backend(name: str, device: torch.device, head_dim: Optional[int] = None,
                    block_size: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> str:
    """Map a backend name (or "auto") to a registered, usable backend name.

    With ``head_dim``, ``block_size`` and ``dtype`` given, "auto" on CUDA is the measured
    choice of :func:`auto_choice`; without them, the rule (:func:`rule_backend`).
    """
    if (name == "auto" and backends.overridden() is None and device.type == "cuda"
            and None not in (head_dim, block_size, dtype)):
        return auto_choice(device, head_dim, block_size, dtype)["backend"]
    return rule_backend(name, device)
