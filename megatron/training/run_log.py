"""Rank 0's view of a run: one :class:`StepLog` per step, the console/tensorboard
output and the final summary (``SUMMARY_JSON`` line and ``--summary-json``); the last
rank's Weights & Biases run (``--wandb-project``, :mod:`megatron.training.wandb_log`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from megatron.training import wandb_log
from megatron.training.failsafe import strict_json
from sparsebalance.io import atomic_write_text


@dataclass
class StepLog:
    """One step as rank 0 reports it."""

    iteration: int
    """1-based iteration number after this step."""
    loss: float
    """Per-token loss over the global batch."""
    lr: float
    """Learning rate used by this step."""
    grad_norm: float
    """Global grad norm before clipping."""
    step_s: float
    """Wall time of the step (seconds)."""
    tokens: int
    """Tokens in the global batch."""
    params_norm: Optional[float] = None
    """L2 norm of the parameters after the step (``--log-params-norm``; else None)."""
    num_zeros_in_grad: Optional[float] = None
    """Zeros in the step's gradients (``--log-num-zeros-in-grad``; else None)."""
    stage_fwd_s: List[float] = field(default_factory=list)
    """Forward compute seconds per pipeline stage (max over DP ranks)."""
    stage_bwd_s: List[float] = field(default_factory=list)
    """Backward compute seconds per pipeline stage (max over DP ranks)."""
    pack_ms: float = 0.0
    """CPU time of the sampler's packing of this step (ms)."""
    plan_ms: float = 0.0
    """Wall time of the DST instance + plan, or of the prediction without DST (ms)."""
    plan_wait_ms: float = 0.0
    """Part of plan_ms the step waited for (less when planned ahead in the background)."""
    predicted_step_ms: Optional[float] = None
    """Pipeline model + predictor's step time at the step's budgets (None: no predictor)."""
    imbalance: float = 1.0
    """max / mean over the global batch's micro-batches of measured latency (sum over
    stages of forward + backward compute)."""
    bubble: List[float] = field(default_factory=list)
    """Per pipeline stage: 1 - busy / step time, measured, mean over DP ranks."""
    kept_pairs: float = 0.0
    """Attention (query, key) pairs kept, all ranks and layers (0 without records)."""
    causal_pairs: float = 0.0
    """Causal (query, key) pairs behind ``kept_pairs``."""
    static_density: Optional[float] = None
    """Kept / causal pairs the step's documents would have at the static ``--sb-topk``
    (every layer), counted from the routing rule; None without sparse attention."""
    peak_memory_mb: List[float] = field(default_factory=list)
    """Per global rank: its memory high-water mark so far, MB (2**20 bytes)
    (:func:`megatron.training.step.peak_memory_mb`: CUDA max allocated on GPU, peak
    RSS of the process on CPU)."""
    profiled: bool = False
    """Ran under ``--profile`` (left out of the summary's timing)."""
    compiles_by_kind: dict = field(default_factory=dict)
    """:func:`kernel_compiles_by_kind` on rank 0 after this step (a count that grows after
    step 2 means a shape or budget reached a compile key; the kind names the cache)."""

    @property
    def compiles(self) -> int:
        """JIT compilations held after this step, all kinds together."""
        return sum(self.compiles_by_kind.values())

    @property
    def density(self) -> float:
        """Achieved attention density of the step (1.0 when dense / unrecorded)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0


def retained_vs_static(steps: List[StepLog], density: float) -> Optional[float]:
    """Measured density over the run / the static top-k's density on the same
    documents (weighted by causal pairs like the measured one); 1.0 = static."""
    pairs = [(s.static_density, s.causal_pairs) for s in steps if s.static_density is not None]
    weight = sum(c for _, c in pairs)
    if not pairs or weight <= 0:
        return None
    static = sum(d * c for d, c in pairs) / weight
    return density / static if static > 0 else None


def warmup_steps(n: int) -> int:
    """Steps skipped by the timing medians: max(2, 10%), but never all of them."""
    skip = max(2, n // 10)
    return skip if n > skip else 0


def routing_used() -> str:
    """How the sparse backends' plans were routed (fused Triton kernels or torch ops)."""
    plan = sys.modules.get("sparsebalance.ops.plan")
    return plan.route_used() if plan is not None else "torch"


def _compiles(module: str) -> int:
    """``module.compile_count()``, 0 for a module this process never loaded."""
    mod = sys.modules.get(module)
    return int(mod.compile_count()) if mod is not None else 0


def kernel_compiles_by_kind() -> dict:
    """JIT compilations the sparse attention path holds in this process, by where they are
    held (FA4's kernels, flex's graphs, the fused routing's kernels), so a late one can be named."""
    return {m: _compiles(f"sparsebalance.ops.{m}") for m in ("fa4", "flex", "route_kernels")}


def loss_path_used() -> str:
    """How the output layer + loss ran: megatron-core's own path, or with
    ``--cross-entropy-fusion-impl linear`` fused (one rank of TP) or checkpointed in chunks."""
    mod = sys.modules.get("megatron.training.loss_chunks")
    used = mod.loss_path["used"] if mod is not None else None
    return f"chunks ({used})" if used else "megatron-core"


def flex_compile_count() -> int:
    """Graphs the flex backend compiled in this process (0 when it never ran)."""
    return _compiles("sparsebalance.ops.flex")


_PEAK_RANKS_SHOWN = 16
"""Log lines list every rank's peak memory up to this many ranks, else the max and its rank."""


def peak_memory_text(peaks: List[float]) -> str:
    """``peak mem MB [r0 r1 ...]`` for the log line (``peak mem MB max X (rank r)`` on
    large worlds)."""
    if len(peaks) <= _PEAK_RANKS_SHOWN:
        return "peak mem MB [" + " ".join(f"{p:.0f}" for p in peaks) + "]"
    r = int(np.argmax(peaks))
    return f"peak mem MB max {peaks[r]:.0f} (rank {r})"


class RunLogger:
    """Rank-0 console (tqdm bar + log lines), tensorboard and the final summary; the
    last rank's W&B run. Every rank holds the same :class:`StepLog` values."""

    def __init__(self, args, rank: int, sb, start: int) -> None:
        """``sb``: the run's :class:`~sparsebalance.config.SparseBalanceConfig` (its
        ``--sb-*`` settings are read there, not from ``args``)."""
        self.args, self.rank, self.sb, self.start = args, rank, sb, start
        self.steps: List[StepLog] = []
        self.profile: Optional[dict] = None
        """``--profile --use-pytorch-profiler``'s kernel split (megatron/training/profiling.py)."""
        self.bar = None
        self.tb = None
        # Megatron-LM's rank for W&B (its losses live on the last pipeline stage)
        self.wandb = wandb_log.open_run(args, rank, getattr(args, "world_size", 1))
        if rank != 0:
            return
        if not args.no_progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=args.train_iters, initial=start, unit="it", dynamic_ncols=True)
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=args.tensorboard_dir)

    def info(self, text: str) -> None:
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def _write(self, scalars: List[Tuple[str, Optional[float]]], iteration: int) -> None:
        """Tensorboard (rank 0) and W&B (last rank) scalars; None values are left out."""
        if self.tb is not None:
            for name, value in scalars:
                if value is not None:
                    self.tb.add_scalar(name, value, iteration)
        if self.wandb is not None:
            wandb_log.log(self.wandb, scalars, iteration)

    def step(self, s: StepLog) -> None:
        self.steps.append(s)
        tps = s.tokens / s.step_s if s.step_s > 0 else 0.0
        scalars = [("loss", s.loss), ("lr", s.lr), ("grad-norm", s.grad_norm), ("step-time-s", s.step_s),
                   ("tokens-per-s", tps), ("imbalance", s.imbalance), ("density", s.density),
                   ("pack-ms", s.pack_ms), ("plan-ms", s.plan_ms),
                   ("peak-memory-mb", max(s.peak_memory_mb, default=0.0)),
                   ("params-norm", s.params_norm), ("num-zeros", s.num_zeros_in_grad)]
        for i, (f, b) in enumerate(zip(s.stage_fwd_s, s.stage_bwd_s)):
            scalars += [(f"stage{i}/fwd-s", f), (f"stage{i}/bwd-s", b)]
        self._write(scalars, s.iteration)
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{s.loss:.4f}", tok_s=f"{tps:.0f}")
        if s.iteration % self.args.log_interval == 0:
            fwd = " ".join(f"{t * 1e3:.0f}" for t in s.stage_fwd_s)
            bwd = " ".join(f"{t * 1e3:.0f}" for t in s.stage_bwd_s)
            extra = ""
            if self.sb.attention.sparse:
                extra += f" | density {s.density:.3f}"
            if s.predicted_step_ms is not None:
                extra += (f" | predicted {s.predicted_step_ms:.1f} ms | plan {s.plan_ms:.1f} ms"
                          f" (waited {s.plan_wait_ms:.1f})")
            if s.params_norm is not None:
                extra += f" | params norm {s.params_norm:.3f}"
            if s.num_zeros_in_grad is not None:
                extra += f" | num zeros {s.num_zeros_in_grad:.0f}"
            bub = " ".join(f"{b:.2f}" for b in s.bubble)
            self.info(f"iter {s.iteration:6d}/{self.args.train_iters} | loss {s.loss:.4f} | lr {s.lr:.3e} | "
                      f"grad-norm {s.grad_norm:.3f} | step {s.step_s * 1e3:.0f} ms | "
                      f"tokens/s {tps:.0f} | fwd ms/stage [{fwd}] | bwd ms/stage [{bwd}] | "
                      f"bubble [{bub}] | imbalance {s.imbalance:.2f} | pack {s.pack_ms:.1f} ms | "
                      f"{peak_memory_text(s.peak_memory_mb)}{extra}")

    def eval(self, iteration: int, loss: float) -> None:
        self.info(f"iter {iteration:6d} | validation loss {loss:.4f}")
        scalars = [("validation-loss", loss)]
        if self.args.log_validation_ppl_to_tensorboard:
            # Megatron-LM's cap: exp(20) keeps an untrained model's perplexity finite
            scalars.append(("validation-ppl", math.exp(min(20.0, loss))))
        self._write(scalars, iteration)

    def summary(self, preempted: bool) -> dict:
        steps = self.steps
        times = np.array([s.step_s for s in steps]) if steps else np.zeros(1)
        tokens = int(sum(s.tokens for s in steps))
        out = {
            "iterations": len(steps),
            "last_iteration": steps[-1].iteration if steps else self.start,
            "tokens": tokens,
            "median_step_s": float(np.median(times)),
            "tokens_per_s": float(tokens / times.sum()) if steps and times.sum() > 0 else 0.0,
            "first_loss": steps[0].loss if steps else None,
            "last_loss": steps[-1].loss if steps else None,
            "losses": [s.loss for s in steps],
            "grad_norms": [s.grad_norm for s in steps],
            "params_norms": [s.params_norm for s in steps] if self.args.log_params_norm else None,
            "num_zeros_in_grad": [s.num_zeros_in_grad for s in steps] if self.args.log_num_zeros_in_grad else None,
            "preempted": preempted,
        }
        out.update(self._balance_metrics())
        if self.wandb is not None:
            self.wandb.finish()
        if self.rank == 0:
            if self.bar is not None:
                self.bar.close()
            if self.tb is not None:
                self.tb.close()
            rows = [("iterations", f"{out['iterations']} (ended at {out['last_iteration']})"),
                    ("tokens", f"{tokens}"),
                    ("median step time", f"{out['median_step_s'] * 1e3:.1f} ms"),
                    ("tokens/s", f"{out['tokens_per_s']:.0f}"),
                    ("first loss", "-" if out["first_loss"] is None else f"{out['first_loss']:.4f}"),
                    ("last loss", "-" if out["last_loss"] is None else f"{out['last_loss']:.4f}")]
            if out["peak_memory_mb_max"] is not None:
                rows.append(("peak memory", f"{out['peak_memory_mb_max']:.0f} MB (max over ranks, "
                                            f"{out['peak_memory_source']})"))
            if preempted:
                rows.append(("stopped by", "signal (checkpoint saved)"))
            width = max(len(k) for k, _ in rows)
            lines = ["", "Training summary", "-" * (width + 24)]
            lines += [f"{k:<{width}}  {v}" for k, v in rows]
            print("\n".join(lines), flush=True)
            print("SUMMARY_JSON " + strict_json(out), flush=True)
            if self.args.summary_json:
                atomic_write_text(self.args.summary_json, strict_json(out))
        return out

    def attention_backend(self) -> dict:
        """The kernel backend the run's attention resolves to and why (``{"backend",
        "reason", ...}``, :func:`sparsebalance.balancer.attention_backend_choice`): the
        training log line and the summary's ``attention_backend`` /
        ``attention_backend_reason``."""
        from sparsebalance.balancer import attention_backend_choice

        a = self.args
        head_dim = a.kv_channels or a.hidden_size // a.num_attention_heads
        return attention_backend_choice(self.sb.attention, self.sb.parallel, head_dim, self.sb.predictor.bf16)

    def _balance_metrics(self) -> dict:
        """The evaluation tool's metrics (see pretrain_gpt.py --summary-json). Timing
        metrics skip the warm-up steps (:func:`warmup_steps`); density and losses use
        every step of this run."""
        from megatron.training.initialize import use_cpu
        from megatron.training.step import peak_memory_source

        steps = self.steps
        timed = [s for s in steps if not s.profiled]
        counted = timed[warmup_steps(len(timed)):]
        backend = self.attention_backend()
        med = lambda xs: float(np.median(xs)) if len(xs) else None
        t_s = sum(s.step_s for s in counted)
        kept, causal = sum(s.kept_pairs for s in steps), sum(s.causal_pairs for s in steps)
        preds = [s.predicted_step_ms for s in counted if s.predicted_step_ms is not None]
        bubbles = np.array([s.bubble for s in counted]) if counted else np.zeros((0, 0))
        # per rank, the largest high-water mark seen over the run (MB = 2**20 bytes)
        peaks = np.max([s.peak_memory_mb for s in steps], axis=0) if steps else np.zeros(0)
        keys = ("sparse_attention", "sparse_balance", "sb_batching", "max_carry_steps", "sb_dst",
                "sb_anchor", "sb_p", "sb_topk", "sb_topk_min", "sb_topk_max", "sb_attn_slack",
                "sb_dst_sensitivity", "sb_stage_sensitivity", "sb_dst_taus", "sb_dst_tau_study",
                "sb_block_size", "sb_attention_backend", "sb_routing", "sb_threshold",
                "sb_threshold_counts", "sb_profile", "sb_cost_model",
                "sb_allow_stale_profile", "num_layers", "hidden_size", "num_attention_heads",
                "seq_length", "global_batch_size", "num_microbatches", "data_parallel_size",
                "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "tensor_model_parallel_size", "seed", "train_iters", "data_path", "mask_prompt_loss",
                "finetune", "load", "recompute_granularity", "recompute_method", "recompute_num_layers")
        return {
            "step_ms_median": med([s.step_s * 1e3 for s in counted]),
            "step_ms_all": [s.step_s * 1e3 for s in steps],
            "step_tokens_all": [int(s.tokens) for s in steps],
            "step_profiled_all": [s.profiled for s in steps],
            "warmup_steps_skipped": len(timed) - len(counted),
            "profiled_steps": len(steps) - len(timed),
            "profile": self.profile,
            "tokens_per_s": float(sum(s.tokens for s in counted) / t_s) if t_s > 0 else 0.0,
            "loss_first": steps[0].loss if steps else None,
            "loss_last": steps[-1].loss if steps else None,
            "density_mean": kept / causal if causal else 1.0,
            "retained_vs_static": retained_vs_static(steps, kept / causal if causal else 1.0),
            "imbalance_mean": float(np.mean([s.imbalance for s in counted])) if counted else None,
            "bubble_fraction": bubbles.mean(axis=0).tolist() if len(counted) else [],
            "predicted_step_ms_median": med(preds) if preds else None,
            "pack_ms_median": med([s.pack_ms for s in counted]),
            "plan_ms_median": med([s.plan_ms for s in counted]) if preds else None,
            "plan_wait_ms_median": med([s.plan_wait_ms for s in counted]) if preds else None,
            "attention_backend": backend["backend"],
            "attention_backend_reason": backend["reason"],
            "dense_kernel": backend.get("dense_kernel"),
            "flex_compiles": flex_compile_count(),
            "kernel_compiles_all": [s.compiles for s in steps],
            "kernel_compiles_after_step_2": steps[-1].compiles - steps[1].compiles if len(steps) > 2 else None,
            "kernel_compiles_by_kind": kernel_compiles_by_kind(),
            "kernel_compiles_late_by_kind": ({k: v - steps[1].compiles_by_kind.get(k, 0)
                                              for k, v in steps[-1].compiles_by_kind.items()}
                                             if len(steps) > 2 else None),
            "routing": routing_used(),
            "loss_path": loss_path_used(),
            "peak_memory_mb": peaks.tolist(),
            "peak_memory_mb_max": float(peaks.max()) if len(peaks) else None,
            "peak_memory_source": peak_memory_source(use_cpu(self.args)),
            "args": {k: getattr(self.args, k, None) for k in keys},  # the flags as given
        }
