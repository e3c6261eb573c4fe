"""What a run checks before its first step, and what a resume compares with its checkpoint.

* :func:`check_save_dir`: ``--save`` can be created and written, and its file system has
  room for one checkpoint (:func:`checkpoint_bytes`), before any training: otherwise the
  first save would fail after ``--save-interval`` iterations of work. One ``ValueError``
  line naming the path; a directory this check created is removed again.
* :func:`run_settings` / :func:`changed_settings`: the sparse-attention and SparseBalance
  settings a checkpoint records, and one line per setting a resume changes (a resume may
  change them on purpose, e.g. a larger top-k late in training; it should not go unseen).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import List, Optional

RESUME_SETTINGS = {
    "sparse_attention": "--sparse-attention",
    "sb_block_size": "--sb-block-size",
    "sb_topk": "--sb-topk",
    "sb_dense_layers": "--sb-dense-layers",
    "sb_attention_backend": "--sb-attention-backend",
    "sb_routing": "--sb-routing",
    "sb_threshold": "--sb-threshold",
    "sb_threshold_counts": "--sb-threshold-counts",
    "sb_batching": "--sb-batching",
    "max_carry_steps": "--max-carry-steps",
    "sb_dst": "--sb-dst",
    "sb_anchor": "--sb-anchor",
    "sb_p": "--sb-p",
    "sb_topk_min": "--sb-topk-min",
    "sb_topk_max": "--sb-topk-max",
    "sb_attn_slack": "--sb-attn-slack",
    "sb_dst_floor": "--sb-dst-floor",
    "sb_dst_sensitivity": "--sb-dst-sensitivity",
    "sb_stage_sensitivity": "--sb-stage-sensitivity",
    "sb_dst_taus": "--sb-dst-taus",
    "sb_dst_tau_study": "--sb-dst-tau-study",
    "sb_plan_ahead": "DST planning ahead (--no-sb-plan-ahead turns it off)",
    "sb_profile": "--sb-profile",
    "sb_cost_model": "--sb-cost-model",
}
"""``args`` field -> how a changed-setting line names it (the flags of the sparse attention
and SparseBalance groups, after :func:`megatron.training.arguments.validate`)."""


def run_settings(args: argparse.Namespace) -> dict:
    """This run's :data:`RESUME_SETTINGS` values (JSON types: the checkpoint's common state)."""
    return {k: list(v) if isinstance(v, (list, tuple)) else v
            for k, v in ((k, getattr(args, k, None)) for k in RESUME_SETTINGS)}


def changed_settings(saved: Optional[dict], now: dict) -> List[str]:
    """One line per setting whose value differs from the checkpoint's (``saved``; None: the
    checkpoint predates this record, nothing to compare)."""
    if not saved:
        return []
    show = lambda v: "off" if v is False else "on" if v is True else "none" if v in (None, []) else \
        " ".join(map(str, v)) if isinstance(v, list) else str(v)
    return [f"resuming with {RESUME_SETTINGS[k]} {show(now[k])} (the checkpoint's: {show(saved[k])})"
            for k in RESUME_SETTINGS if k in saved and k in now and saved[k] != now[k]]


def checkpoint_bytes(args: argparse.Namespace, vocab: int) -> int:
    """A lower bound of one checkpoint's size in bytes: the matrices of the model (fp32, or
    16-bit with ``--bf16``/``--fp16``) and, unless ``--no-save-optim``, the optimizer state
    (fp32 main parameters with 16-bit weights, Adam's two moments or SGD's momentum).
    Biases, norms and metadata are left out, so less free space than this cannot hold it."""
    h, f = args.hidden_size, args.ffn_hidden_size
    kv = args.kv_channels or h // args.num_attention_heads
    q = args.num_attention_heads * kv
    g = (args.num_query_groups or args.num_attention_heads) * kv
    gate = q if getattr(args, "attention_output_gate", False) else 0  # projected with the QKV
    layer = h * (q + 2 * g + gate) + q * h + (3 if args.swiglu else 2) * h * f
    params = args.num_layers * layer + vocab * h * (2 if args.untie_embeddings_and_output_weights else 1)
    if args.position_embedding_type == "learned_absolute":
        params += args.max_position_embeddings * h
    half = args.bf16 or args.fp16
    per = 2 if half else 4
    if not args.no_save_optim:
        moments = 8 if args.optimizer == "adam" else (4 if args.sgd_momentum else 0)
        per += (4 if half else 0) + moments
    return params * per


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_save_dir(path: str, need_bytes: int) -> None:
    """``--save PATH`` can hold a checkpoint of ``need_bytes``; else ``ValueError`` (one line)."""
    made = []
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        made.append(probe)
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"--save {path}: {probe} is a file, not a directory")
    try:
        try:
            os.makedirs(path, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=".write-test-", dir=path)
            os.close(fd)
            os.unlink(name)
        except OSError as e:
            raise ValueError(f"--save {path}: cannot write there ({e.strerror or e})") from None
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        if st.f_blocks and free < need_bytes:  # a file system reporting no size at all is not judged
            raise ValueError(f"--save {path}: {_size(free)} free on its file system; a checkpoint of this "
                             f"model needs at least {_size(need_bytes)} (ENOSPC at the first save otherwise)")
    except ValueError:
        for d in made:  # leave nothing behind: the directories this check created, deepest first
            try:
                os.rmdir(d)
            except OSError:
                pass
        raise
