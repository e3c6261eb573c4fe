"""Megatron-LM's ``--profile`` flags: profile a window of training steps.

``--profile`` profiles the steps that start after iteration ``--profile-step-start`` and end
by iteration ``--profile-step-end`` (Megatron-LM's defaults: 10 and 12, so iterations 11
and 12) on the ranks of ``--profile-ranks``. Without ``--use-pytorch-profiler`` the window
is bracketed by ``cudaProfilerStart/Stop`` for an outer ``nsys profile
--capture-range=cudaProfilerApi``; with it, torch.profiler records the window, the trace
goes to ``--tensorboard-dir`` (``profile_rank<R>_iter<A>-<B>.pt.trace.json``) when one is
given, and the log and the run summary get the kernel time split into attention and the
rest (:func:`kernel_split`). Profiled steps are left out of the summary's timing."""

from __future__ import annotations

import os
import re
import time
from typing import Optional

ATTENTION_KERNELS = re.compile(
    r"flash|fmha|sdpa|attention|attn|triton_tem|\b_?(fwd_kernel|bwd_dq_kernel|bwd_dkdv_kernel)\b",
    re.IGNORECASE)
"""Kernel (or, on CPU, operator) names counted as attention: FlashAttention-4 and PyTorch's
flash/cuDNN/memory-efficient SDPA, flex attention's Triton templates and this project's
Triton and CUDA sparse kernels. Routing (block scoring, top-k) counts as the rest."""


def _on_device(event) -> bool:
    """Whether a profiler event ran on the accelerator (a kernel, a copy, a memset)."""
    return str(getattr(event, "device_type", "")).endswith("CUDA")


KERNEL_CLASSES = (
    ("attention", ATTENTION_KERNELS),
    ("routing", re.compile(r"_block_means_kernel|_route_kernel|_threshold_kernel|_bwd_desc_kernel|topk|sort",
                           re.IGNORECASE)),
    ("loss", re.compile(r"_lse_kernel|_grad_kernel|cross_entropy|log_softmax|nll_loss|logsumexp", re.IGNORECASE)),
    ("weight_gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|s16816|aten::mm|aten::addmm|aten::bmm|"
                               r"aten::linear|aten::matmul", re.IGNORECASE)),
    ("optimizer", re.compile(r"multi_tensor|adam|_foreach|optimizer|l2norm|clip_grad", re.IGNORECASE)),
    ("communication", re.compile(r"nccl|gloo|c10d|all_reduce|allreduce|all_gather|reduce_scatter|send|recv",
                                 re.IGNORECASE)),
    ("memory", re.compile(r"memcpy|memset|aten::copy_|aten::fill_|aten::zero_", re.IGNORECASE)),
    ("norm_elementwise", re.compile(r"norm|elementwise|vectorized|unrolled|reduce|silu|gelu|swiglu|rotary|rope|"
                                    r"softmax|mul|add|div|cat|index|gather|scatter|where|clamp|exp|triton_",
                                    re.IGNORECASE)),
)
"""Kernel classes of the step breakdown, tried in order (first match wins; the rest is
``other``). Recompute is not a class: a recomputed forward runs the same kernels as the
forward, so its time sits inside the classes above (compare a run with and without
``--recompute-*`` to price it)."""


def kernel_classes(rows) -> dict:
    """Milliseconds per class of :data:`KERNEL_CLASSES` (plus ``other``) of ``(name, us)`` rows;
    the classes add up to the rows' total."""
    out = {name: 0.0 for name, _ in KERNEL_CLASSES}
    out["other"] = 0.0
    for key, us in rows:
        cls = next((name for name, rx in KERNEL_CLASSES if rx.search(key)), "other")
        out[cls] += us / 1e3
    return out


HOST_SYNCS = re.compile(r"Synchronize|cudaMemcpy(?!Async)|aten::item|aten::_local_scalar_dense", re.IGNORECASE)
"""Host calls that wait for the device (their self time is ``host_sync_ms``)."""


def kernel_split(events) -> dict:
    """Self time of the profiled kernels from ``prof.key_averages()``: the device's kernels
    when any ran on an accelerator, else the CPU operators. Returns ``kernel_ms``,
    ``attention_ms``, ``attention_share``, ``device``, the time per kernel class
    (``classes_ms``, :func:`kernel_classes`) and the five longest kernels; with an
    accelerator also the eight host operators of most self time (``top_host_ops``) and the
    host's time in calls that wait for the device (``host_sync_ms``)."""
    events = list(events)
    on_device = [e for e in events if _on_device(e)
                 and e.self_device_time_total > 0]
    if on_device:
        rows, device = [(e.key, e.self_device_time_total) for e in on_device], "cuda"
    else:
        rows, device = [(e.key, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0], "cpu"
    total = sum(us for _, us in rows)
    attn = sum(us for name, us in rows if ATTENTION_KERNELS.search(name))
    top = sorted(rows, key=lambda r: -r[1])[:5]
    out = {"device": device, "kernel_ms": total / 1e3, "attention_ms": attn / 1e3,
           "attention_share": attn / total if total > 0 else None,
           "classes_ms": kernel_classes(rows),
           "top_kernels": [{"name": name[:160], "ms": us / 1e3} for name, us in top]}
    if on_device:  # where the host spent the window: what points at a device left waiting
        host = sorted((e for e in events if not _on_device(e)
                       and e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
        out["top_host_ops"] = [{"name": e.key[:160], "ms": e.self_cpu_time_total / 1e3, "calls": e.count}
                               for e in host[:8]]
        out["host_sync_ms"] = sum(e.self_cpu_time_total for e in host if HOST_SYNCS.search(e.key)) / 1e3
    return out


def device_busy_ms(events) -> Optional[float]:
    """Milliseconds in which at least one kernel ran on the accelerator (the union of the
    kernels' intervals from ``prof.events()``); None when none ran there. Against the
    window's wall time it shows how long the device waited for the host."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if _on_device(e) and e.time_range.end > e.time_range.start)
    if not spans:
        return None
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    return (busy + hi - lo) / 1e3


class StepProfiler:
    """Starts and stops profiling around the training loop's steps (module docstring)."""

    def __init__(self, args, rank: int):
        self.args = args
        self.rank = rank
        self.enabled = bool(getattr(args, "profile", False)) and rank in (args.profile_ranks or [0])
        self.active = False
        self.torch_prof = None
        self.result: Optional[dict] = None

    def before_step(self, iteration: int) -> bool:
        """Called with the iterations done before a step; True when this step is profiled."""
        a = self.args
        if self.enabled and not self.active and a.profile_step_start <= iteration < a.profile_step_end:
            self._start()
        return self.active

    def after_step(self, iteration: int, log=None) -> None:
        """Called with the iterations done after a step; stops at ``--profile-step-end``."""
        if self.active and iteration >= self.args.profile_step_end:
            self.stop(iteration, log)

    def _start(self) -> None:
        import torch

        if self.args.use_pytorch_profiler:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_prof = torch.profiler.profile(
                activities=acts,
                record_shapes=bool(self.args.record_shapes or self.args.pytorch_profiler_collect_shapes),
                with_stack=bool(self.args.pytorch_profiler_collect_callstack))
            self.torch_prof.start()
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        self.t0 = time.perf_counter()
        self.active = True

    def stop(self, iteration: int, log=None) -> None:
        """Ends the window (also when training stops inside it) and reports it."""
        import torch

        if not self.active:
            return
        self.active = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        first = self.args.profile_step_start + 1
        if self.torch_prof is None:
            if torch.cuda.is_available():
                torch.cuda.profiler.stop()
            return
        wall_ms = (time.perf_counter() - self.t0) * 1e3
        self.torch_prof.stop()
        split = kernel_split(self.torch_prof.key_averages())
        busy = device_busy_ms(self.torch_prof.events())
        self.result = {"iterations": [first, iteration], "wall_ms": wall_ms, "device_busy_ms": busy,
                       # the device waiting for the host (the breakdown's "idle")
                       "idle_ms": max(wall_ms - busy, 0.0) if busy is not None else None, **split}
        if self.args.tensorboard_dir:
            os.makedirs(self.args.tensorboard_dir, exist_ok=True)
            path = os.path.join(self.args.tensorboard_dir,
                                f"profile_rank{self.rank}_iter{first}-{iteration}.pt.trace.json")
            tmp = path + ".tmp"
            self.torch_prof.export_chrome_trace(tmp)
            os.replace(tmp, path)
            self.result["trace"] = path
        self.torch_prof = None
        if log is not None:
            share, busy = split["attention_share"], self.result["device_busy_ms"]
            log.info(f"profile of iterations {first}-{iteration} (rank {self.rank}): {wall_ms:.1f} ms wall, "
                     + (f"device busy {busy:.1f} ms, " if busy is not None else "")
                     + f"{split['kernel_ms']:.1f} ms of {split['device']} kernels, attention "
                     f"{split['attention_ms']:.1f} ms" + (f" ({share:.0%})" if share is not None else ""))
