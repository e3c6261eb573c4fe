"""Profile JSON: hardware + model fingerprints, raw samples, fitted coefficients.

Format (``"format": "sparsebalance-latency-profile"``, version 1)::

    {"format", "version", "created", "command",
     "hardware": {"cpu", "gpu", "torch", "threads"},
     "timing": {"clock", "statistic", "repeats", "warmup"},
     "model": {ModelShape fields..., "attention_backend", "normalization", ...},
     "samples": [{"kind", "phase", "lengths", "topk", "ms", "repeats_ms"}, ...],
     "coefficients": {"layer": {"fwd": {...}, "bwd": {...}}, "embedding": ..., "output": ...}}

A profile describes one layer of one model shape on one machine. Loading it for
another machine or shape warns, naming every difference, and refuses unless
``allow_stale=True`` (``--sb-allow-stale-profile``): the planners would otherwise
silently optimise for the wrong costs. ``num_layers`` and ``topk`` are not part of
the check (a layer's cost does not depend on the layer count, and the profile
covers several budgets).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import time
import warnings
from dataclasses import fields
from typing import Any, Optional

import torch

from sparsebalance.config import ModelShape
from sparsebalance.io import atomic_write_text
from sparsebalance.predictor.fitted import FittedPredictor, fit_coefficients
from sparsebalance.predictor.recalibration import Recalibrator

FORMAT = "sparsebalance-latency-profile"
VERSION = 1
NOT_FINGERPRINTED = frozenset({"num_layers", "topk", "first_stage_layers", "last_stage_layers", "stage_layers"})
"""Model fields a per-layer profile stays valid for when they change."""
_SHAPE_FIELDS = tuple(f.name for f in fields(ModelShape))
_CACHE: dict[str, tuple[dict, dict]] = {}
"""sha256(profile bytes) -> (model fingerprint, coefficients)."""


def cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (platform string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_fingerprint(threads: Optional[int] = None) -> dict[str, Any]:
    """What the timings depend on besides the model: CPU, GPU, torch, threads."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "gpu": gpu, "torch": torch.__version__,
            "threads": int(threads if threads is not None else torch.get_num_threads())}


def make_profile(hardware: dict, model: dict, samples: list[dict], command: str,
                 timing: Optional[dict] = None) -> dict:
    """Assemble a profile and fit its coefficients.

    ``timing`` records how samples were taken (clock, statistic, repeats, warm-up).
    """
    return {"format": FORMAT, "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": command, "hardware": hardware, "model": model,
            "timing": dict(timing or {}), "samples": samples,
            "coefficients": fit_coefficients(samples, int(model["block_size"]))}


def save_profile(path: str, profile: dict) -> None:
    """Write a profile atomically."""
    atomic_write_text(path, json.dumps(profile, indent=1) + "\n")


def create_command(path: str, model_cfg: dict, threads: Optional[int] = None,
                   sparse: bool = True) -> str:
    """The exact command that writes a profile for ``model_cfg`` to ``path``
    (``sparse``: profile the sparse-attention layer, as SparseBalance trains).

    ``model_cfg`` holds ModelShape fields and optionally the other model-fingerprint
    entries (``seq_length``, ``normalization``, ``params_dtype``, ``attention_backend``);
    every one given becomes its flag, so the written profile matches that fingerprint."""
    flags = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
             "num_attention_heads": "--num-attention-heads",
             "num_query_groups": "--num-query-groups", "ffn_hidden_size": "--ffn-hidden-size",
             "vocab_size": "--vocab-size", "block_size": "--sb-block-size", "topk": "--sb-topk",
             "seq_length": "--seq-length", "normalization": "--normalization"}
    argv = ["--output", path] + (["--sparse-attention"] if sparse else [])
    for key, flag in flags.items():
        if model_cfg.get(key) is not None:
            argv += [flag, str(model_cfg[key])]
    groups, heads = model_cfg.get("num_query_groups"), model_cfg.get("num_attention_heads")
    if groups is not None and groups != heads:
        argv.append("--group-query-attention")  # Megatron-LM reads --num-query-groups only with it
    if model_cfg.get("swiglu"):
        argv.append("--swiglu")
    if model_cfg.get("params_dtype") == "bf16":
        argv.append("--bf16")
    if sparse and model_cfg.get("attention_backend") not in (None, "auto"):
        # the resolved kernel the run expects; "auto" could resolve differently
        argv += ["--sb-attention-backend", str(model_cfg["attention_backend"])]
    t = threads if threads is not None else torch.get_num_threads()
    return (f"OMP_NUM_THREADS={t} .venv/bin/python tools/profile_latency.py "
            + " ".join(shlex.quote(a) for a in argv))


def fingerprint_diffs(profile: dict, model_cfg: dict, expect: Optional[dict] = None,
                      hardware: Optional[dict] = None) -> list[str]:
    """Human-readable differences between a profile and the running setup."""
    diffs = []
    now = hardware if hardware is not None else hardware_fingerprint()
    for key in ("cpu", "gpu", "torch", "threads"):
        was = profile["hardware"].get(key)
        if was != now.get(key):
            diffs.append(f"hardware.{key}: profile {was!r}, now {now.get(key)!r}")
    model = profile["model"]
    wanted = {k: v for k, v in model_cfg.items() if k not in NOT_FINGERPRINTED}
    wanted.update(expect or {})
    for key, value in sorted(wanted.items()):
        if model.get(key) != value:
            diffs.append(f"model.{key}: profile {model.get(key)!r}, now {value!r}")
    return diffs


def read_profile(path: str) -> tuple[dict, str]:
    """Parse a profile; returns (profile, sha256 of its bytes). ValueError if malformed."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        prof = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path}: not valid JSON ({e})") from None
    if not isinstance(prof, dict) or prof.get("format") != FORMAT:
        raise ValueError(f"profile {path}: not a {FORMAT} file")
    if prof.get("version") != VERSION:
        raise ValueError(f"profile {path}: version {prof.get('version')!r}, expected {VERSION}")
    for key in ("hardware", "model", "samples"):
        if key not in prof:
            raise ValueError(f"profile {path}: missing {key!r}")
    for key, kind in (("hardware", dict), ("model", dict), ("samples", list)):
        if not isinstance(prof[key], kind):
            raise ValueError(f"profile {path}: {key!r} must be a JSON {kind.__name__}")
    if not all(isinstance(x, dict) and {"kind", "phase", "lengths", "ms"} <= set(x)
               for x in prof["samples"]):
        raise ValueError(f"profile {path}: every sample needs kind, phase, lengths and ms")
    if prof.get("coefficients") is not None and not isinstance(prof["coefficients"], dict):
        raise ValueError(f"profile {path}: 'coefficients' must be a JSON object")
    return prof, hashlib.sha256(raw).hexdigest()


def load_predictor(path: str, recalibrator: Optional[Recalibrator] = None,
                   allow_stale: bool = False, expect: Optional[dict] = None,
                   threads: Optional[int] = None, **model_cfg: Any) -> FittedPredictor:
    """Fitted predictor from a profile, after checking its fingerprints.

    Args:
        path: profile JSON.
        recalibrator: online correction state (a fresh one by default).
        allow_stale: use a profile whose fingerprint differs (after a warning).
        expect: extra model-fingerprint entries to check (e.g. attention_backend).
        threads: the thread count of the run the prediction is for (default: this
            process's); a tool predicting for child processes passes theirs.
        **model_cfg: ModelShape fields of the running model; given ones are checked,
            the others are taken from the profile.

    Raises:
        FileNotFoundError: no such profile (message: the command that creates it).
        ValueError: malformed profile, unknown model_cfg key, or stale fingerprint.
    """
    unknown = sorted(set(model_cfg) - set(_SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"unknown model_cfg keys {unknown}; known: {sorted(_SHAPE_FIELDS)}")
    if not os.path.isfile(path):
        want = {**model_cfg, **(expect or {})}
        raise FileNotFoundError(f"latency profile {path} does not exist; create it with: "
                                f"{create_command(path, want, sparse=want.get('attention') != 'dense')}")
    prof, digest = read_profile(path)
    diffs = fingerprint_diffs(prof, model_cfg, expect, hardware_fingerprint(threads))
    if diffs:
        msg = f"latency profile {path} does not match this run: " + "; ".join(diffs)
        warnings.warn(msg, stacklevel=2)
        if not allow_stale:
            # Re-profiling for this run: the profile's model with the requested changes,
            # at this process's thread count.
            want = {**prof["model"], **model_cfg, **(expect or {})}
            cmd = create_command(path, want, threads, sparse=want.get("attention") != "dense")
            raise ValueError(f"{msg} (re-profile with: {cmd}; pretrain_gpt.py can use it anyway "
                             "with --sb-allow-stale-profile)")
    if digest not in _CACHE:
        coef = prof.get("coefficients") or fit_coefficients(
            prof["samples"], int(prof["model"]["block_size"]))
        _CACHE[digest] = (prof["model"], coef)
    model, coef = _CACHE[digest]
    shape_kw = {k: model[k] for k in _SHAPE_FIELDS if k in model}
    shape_kw.update(model_cfg)
    pred = FittedPredictor(ModelShape(**shape_kw), coef, recalibrator,
                           dense_only=model.get("attention") == "dense")
    # The CP exchange of the profiled machine: gloo between CPU processes, else NVLink.
    pred.default_link = "nvlink" if prof["hardware"].get("gpu") else "gloo-cpu"
    pred.kv_dtype_bytes = 2 if model.get("params_dtype") == "bf16" else 4
    return pred
