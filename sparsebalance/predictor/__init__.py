"""SparseBalance: latency predictor (profiling, cost models, online recalibration).

    from sparsebalance.predictor import LatencyPredictor, get_predictor
    pred = get_predictor("h100-analytic", num_layers=24, block_size=256)
    pred.stage_ms(lengths, topk=32, stage=0, pp=4, phase="fwd")

``get_predictor`` takes a model name (``"h100-analytic"``) or the path of a profile
JSON written by ``tools/profile_latency.py``.
"""

from __future__ import annotations

import os
from typing import Any

from sparsebalance.config import ModelShape
from sparsebalance.predictor.analytic import AnalyticPredictor
from sparsebalance.predictor.base import LatencyPredictor
from sparsebalance.predictor.context_parallel import LINKS, ContextParallel, Link
from sparsebalance.predictor.recalibration import Recalibrator

ANALYTIC_MODELS = {"h100-analytic": AnalyticPredictor}
"""Named cost models that need no profile."""

__all__ = ["LatencyPredictor", "ModelShape", "Recalibrator", "AnalyticPredictor",
           "ANALYTIC_MODELS", "ContextParallel", "Link", "LINKS", "get_predictor"]


def get_predictor(name_or_profile_path: str, **model_cfg: Any) -> LatencyPredictor:
    """Build a predictor by model name or from a profile JSON.

    Args:
        name_or_profile_path: ``"h100-analytic"``, or the path of a profile written by
            ``tools/profile_latency.py``.
        **model_cfg: :class:`ModelShape` fields (``num_layers``, ``hidden_size``,
            ``num_attention_heads``, ``num_query_groups``, ``kv_channels``,
            ``ffn_hidden_size``, ``vocab_size``, ``swiglu``, ``block_size``, ``topk``).
            For a profile, the given fields are checked against the profiled model
            (fields not given are taken from the profile), and two more keys are
            accepted: ``allow_stale`` (bool, default False: a fingerprint mismatch
            raises ValueError after a warning) and ``expect`` (dict of extra
            model-fingerprint entries to check, e.g. ``{"attention_backend": "cpu"}``).
            Optional for both: ``recalibration_alpha`` (EMA weight, default 0.2);
            ``context_parallel_size`` (default 1: per-rank times of a CP group of that
            size, :mod:`sparsebalance.predictor.context_parallel`) and
            ``context_parallel_link`` (a :data:`LINKS` name or a :class:`Link`; default
            the cost model's hardware: NVLink for h100-analytic and GPU profiles, gloo
            for CPU profiles); ``sequence_parallel_size`` (default 1: the TP size under
            sequence parallelism, whose padding is priced, :meth:`LatencyPredictor.set_sequence_parallel`).
            Profiles only: ``threads`` (the thread count of the run predicted for;
            default this process's), checked against the profile's.

    Raises:
        ValueError: unknown name or model_cfg key, or a stale profile.
        FileNotFoundError: a profile path that does not exist (the message gives the
            command that creates it).
    """
    cfg = dict(model_cfg)
    recal = Recalibrator(alpha=float(cfg.pop("recalibration_alpha", 0.2)))
    cp_size = int(cfg.pop("context_parallel_size", 1))
    cp_link = cfg.pop("context_parallel_link", None)
    sp_size = int(cfg.pop("sequence_parallel_size", 1))
    pred = _build(name_or_profile_path, recal, cfg).set_sequence_parallel(sp_size)
    if cp_size != 1 or cp_link is not None:
        link = LINKS.get(cp_link or pred.default_link) if not isinstance(cp_link, Link) else cp_link
        if link is None:
            raise ValueError(f"unknown context_parallel_link {cp_link!r}; known: {sorted(LINKS)}")
        pred.set_context_parallel(ContextParallel(cp_size, link, dtype_bytes=pred.kv_dtype_bytes))
    return pred


def _build(name_or_profile_path: str, recal: Recalibrator, cfg: dict) -> LatencyPredictor:
    if name_or_profile_path in ANALYTIC_MODELS:
        for key in ("allow_stale", "expect", "threads"):
            if key in cfg:
                raise ValueError(f"{key} applies to profiles, not to {name_or_profile_path!r}")
        shape = ModelShape.from_kwargs(**cfg)
        return ANALYTIC_MODELS[name_or_profile_path](shape, recal)
    looks_like_path = (name_or_profile_path.endswith(".json")
                       or os.sep in name_or_profile_path or os.path.exists(name_or_profile_path))
    if not looks_like_path:
        raise ValueError(f"unknown cost model {name_or_profile_path!r}: use one of "
                         f"{sorted(ANALYTIC_MODELS)} or the path of a profile JSON")
    from sparsebalance.predictor.profile import load_predictor

    return load_predictor(name_or_profile_path, recalibrator=recal, **cfg)
