"""One training (or evaluation) step through megatron-core's own pipeline schedules.

``get_forward_backward_func()`` picks no-pipelining, 1F1B or interleaved 1F1B;
we only supply :func:`forward_step` (pull a micro-batch, run ``GPTModel`` on it
as packed THD) and the per-token loss. Gradients are finalised by
megatron-core's ``finalize_model_grads`` (DP all-reduce, then scaling by the
number of loss tokens of the whole global batch).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch


class StageTimers:
    """The ``config.timers`` megatron's schedules call (``timers(name).start()/stop()``).

    Records the wall seconds of every call per name on this rank; the schedules
    time ``forward-compute`` and ``backward-compute`` once per micro-batch (per
    model chunk), in the rank's op order, so call ``i`` of a name is the ``i``-th
    forward (backward) op of this rank's ``order``.

    Args:
        order: this rank's ops ``(phase "F"/"B", micro-batch, chunk)`` in the order its
            schedule runs them (:func:`sparsebalance.pipeline.rank_order`, computed once
            per run), by which :meth:`op_ms` places the timed calls.
    """

    class _Timer:
        def __init__(self, owner: "StageTimers", name: str) -> None:
            self.owner, self.name, self.t0 = owner, name, None

        def start(self, barrier: bool = False) -> None:
            self.t0 = time.perf_counter()

        def stop(self, barrier: bool = False) -> None:
            if self.t0 is not None:
                self.owner.calls[self.name].append(time.perf_counter() - self.t0)
                self.t0 = None

    def __init__(self, order: List[tuple]) -> None:
        self.calls: Dict[str, List[float]] = defaultdict(list)
        self._timers: Dict[str, StageTimers._Timer] = {}
        self._shape = (1 + max(c for _, _, c in order), 1 + max(m for _, m, _ in order))  # (vpp, M)
        self._ops = {ph: [(c, m) for p, m, c in order if p == ph] for ph in ("F", "B")}
        """(chunk, micro-batch) of each timed call of a phase, in the order the schedule runs them."""

    def __call__(self, name: str, log_level: int = 0) -> "_Timer":
        if name not in self._timers:
            self._timers[name] = StageTimers._Timer(self, name)
        return self._timers[name]

    def pop(self) -> Dict[str, List[float]]:
        """Seconds of every call since the last pop, by timer name, in call order."""
        out, self.calls = dict(self.calls), defaultdict(list)
        return out

    def op_ms(self, calls: Dict[str, List[float]]) -> Tuple[np.ndarray, np.ndarray]:
        """Forward and backward ms ``[vpp, M]`` by (chunk, micro-batch) of one step's
        :meth:`pop` output, placed by the rank's op ``order``."""
        out = []
        for phase, name in (("F", "forward-compute"), ("B", "backward-compute")):
            ops, secs = self._ops[phase], calls.get(name, [])
            if len(secs) != len(ops):
                raise RuntimeError(f"{len(secs)} timed {phase} calls on this pipeline rank, "
                                   f"the schedule model expects {len(ops)}")
            table = np.zeros(self._shape)
            if ops:
                table[tuple(np.array(ops).T)] = np.asarray(secs) * 1e3
            out.append(table)
        return out[0], out[1]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss in megatron's 3-tuple form: (sum of token losses, token count, report).

    ``output_tensor`` is GPTModel's per-token cross entropy ``[1, T]``.
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": report}


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def forward_step(data_iterator, model):
    """megatron ``forward_step_func``: next packed micro-batch -> (output, loss_func)."""
    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    batch = next(data_iterator)
    # DST: a micro-batch may carry its top-k on this stage (an int the data iterator put
    # there, data.BudgetIterator), or under threshold routing its TAU; none means the module
    # default (--sb-topk, --sb-threshold).
    budget, tau, microbatch = batch.get("budget"), batch.get("tau"), batch.get("microbatch")
    device = _device_of(model)
    get = lambda k: batch[k].to(device, non_blocking=True)
    cu = get("cu_seqlens")
    max_len = int((batch["cu_seqlens"][1:] - batch["cu_seqlens"][:-1]).max())
    cp_extra, host = {}, batch["cu_seqlens"].to(torch.int32)
    if "cu_seqlens_padded" in batch:  # padded for context or sequence parallelism (data.py)
        cp_extra = _padded_params(batch, device)
        max_len = cp_extra.pop("max_len")
        if "cp_layout" in cp_extra:
            host = None  # under CP the attention reads the layout instead
    # The packed params are the budget's one carrier to the attention modules (and the
    # step's record list the way back); a layer
    # recomputed in backward (--recompute-granularity) gets the same object, so it
    # routes as its original forward did although later micro-batches ran meanwhile.
    # The host copy of the boundaries rides along: routing reads them without a device sync.
    packed = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max_len, max_seqlen_kv=max_len,
                                     budget=budget, tau=tau, microbatch=microbatch, cu_seqlens_host=host,
                                     records=batch.get("records"), **cp_extra)
    output = model(get("tokens"), get("position_ids"), None, labels=get("labels"),
                   packed_seq_params=packed)
    return output, partial(loss_func, get("loss_mask"))


def _padded_params(batch, device) -> dict:
    """Packed-params fields of a padded micro-batch, Megatron's convention: ``cu_seqlens_q``
    holds the real document lengths, ``cu_seqlens_q_padded`` the stored ones (what
    megatron-core's THD RoPE splits, per rank under CP); under CP plus this rank's layout
    for attention. Without CP the padding (sequence parallelism's) trails the last
    document and the attention modules leave it out (``sparsebalance.attention.dense``)."""
    from megatron.core import parallel_state as ps

    padded = batch["cu_seqlens_padded"]
    cu_pad = padded.to(device, non_blocking=True)
    out = {"cu_seqlens_q_padded": cu_pad, "cu_seqlens_kv_padded": cu_pad,
           "max_len": int((padded[1:] - padded[:-1]).max())}
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        from sparsebalance.attention.context_parallel import layout_from_cu

        layout = layout_from_cu(batch["cu_seqlens"], padded, cp, ps.get_context_parallel_rank())
        out["cp_layout"] = layout.to(device)
    return out


@dataclass
class StepResult:
    """What one step measured on this rank (loss only meaningful on the last stage)."""

    loss_sum: float
    """Sum of token losses over this DP rank's micro-batches (0 off the last stage)."""
    loss_tokens: float
    """Loss tokens behind ``loss_sum``."""
    grad_norm: Optional[float] = None
    """Global grad norm before clipping (None in evaluation)."""
    num_zeros_in_grad: Optional[float] = None
    """Zeros in the step's gradients, whole model (``--log-num-zeros-in-grad``; else None)."""
    params_norm: Optional[float] = None
    """L2 norm of the parameters after the update, whole model (``--log-params-norm``; else None)."""
    skipped: bool = False
    """Optimizer skipped the update (inf/nan grads)."""
    stage_times: Dict[str, List[float]] = field(default_factory=dict)
    """Seconds of each call by schedule timer (forward-compute, backward-compute) on
    this rank, in call order."""
    op_ms: Optional[Tuple[np.ndarray, np.ndarray]] = None
    """Forward and backward ms ``[vpp, M]`` of this rank's ops (:meth:`StageTimers.op_ms`)."""
    budget: Optional[object] = None
    """The step's DST budget table ``[dp][microbatch][virtual stage]`` (None: DST off)."""
    tau: Optional[object] = None
    """The step's DST TAU table ``[dp][microbatch][virtual stage]`` under threshold routing
    (None: DST off or top-k routing)."""
    attention_records: list = field(default_factory=list)
    """``AttentionRecord`` of this step's attention calls on this rank
    (``sparsebalance.attention.packed``)."""
    peak_memory_mb: float = 0.0
    """This process's memory high-water mark after the step (:func:`peak_memory_mb`)."""


def run_schedule(args, model: List[torch.nn.Module], batches, forward_only: bool) -> StepResult:
    """Forward (and backward) of one global batch through megatron's schedule."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from sparsebalance.cp_split import sequence_parallel_pad

    forward_backward = get_forward_backward_func()
    iters = batches.iterators(len(model))  # each pull: index, record list, DST budget
    # An upper bound (variable_seq_lengths sends true shapes); the interleaved schedule's
    # padded length (data.py): --seq-length tokens and sequence parallelism's padding.
    seq_length = args.micro_batch_tokens
    if args.sequence_parallel and args.virtual_pipeline_model_parallel_size is not None:
        seq_length += sequence_parallel_pad(seq_length, 1, args.tensor_model_parallel_size)
    outputs = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iters if len(model) > 1 else iters[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=len(batches.microbatches),
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )
    loss_sum = sum(float(o["lm loss"][0]) for o in outputs) if outputs else 0.0
    loss_tokens = sum(float(o["lm loss"][1]) for o in outputs) if outputs else 0.0
    return StepResult(loss_sum=loss_sum, loss_tokens=loss_tokens)


def params_l2_norm(model) -> float:
    """L2 norm of the whole model's parameters (Megatron-LM's ``--log-params-norm``): each
    rank sums the squares of its parameters that are neither shared copies (the tied output
    embedding of the last stage) nor tensor-parallel duplicates, in float64, and the sums
    are added over the model-parallel group (TP x PP), so every layout reports one norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for chunk in model for p in chunk.parameters()
              if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    device = params[0].device if params else torch.device("cpu")  # NCCL sums CUDA tensors
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        total += p.detach().double().square().sum()
    torch.distributed.all_reduce(total, group=ps.get_model_parallel_group())
    return float(total.item()) ** 0.5


def train_step(args, model, optimizer, scheduler, batches, timers: StageTimers,
               validator=None, iteration: int = 0) -> StepResult:
    """Zero grads, run the schedule, finalize grads, Adam step, LR step.

    ``validator`` (:class:`megatron.training.rerun.ResultValidator`, ``--rerun-mode``) checks
    the loss of ``iteration`` before the optimizer step and may run the schedule again."""
    from megatron.training.initialize import use_cpu

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    result = run_schedule(args, model, batches, forward_only=False)
    if validator is not None:
        reruns: List[StepResult] = []

        def rerun() -> float:  # the same step again: grads, records and timings of the first run dropped
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            batches.records.clear()
            timers.pop()
            reruns.append(run_schedule(args, model, batches, forward_only=False))
            return reruns[-1].loss_sum

        validator.check(iteration, result.loss_sum, rerun, _device_of(model[0]))
        result = reruns[-1] if reruns else result
    update_ok, grad_norm, num_zeros = optimizer.step()
    scheduler.step(increment=1)
    result.grad_norm = grad_norm
    result.num_zeros_in_grad = num_zeros
    if args.log_params_norm:
        result.params_norm = params_l2_norm(model)
    result.skipped = not update_ok
    result.stage_times = timers.pop()
    result.op_ms = timers.op_ms(result.stage_times)
    from sparsebalance.attention.packed import read_records

    read_records(batches.records)  # threshold routing's kept pairs: one device-to-host copy per step
    result.attention_records = batches.records
    result.peak_memory_mb = peak_memory_mb(use_cpu(args))
    return result


def evaluate(args, model, loader, iters: int) -> StepResult:
    """Forward-only loss over ``iters`` steps of the validation loader."""
    for chunk in model:
        chunk.eval()
    total = StepResult(0.0, 0.0)
    with torch.no_grad():
        for _ in range(iters):
            r = run_schedule(args, model, loader.next_step(), forward_only=True)
            total.loss_sum += r.loss_sum
            total.loss_tokens += r.loss_tokens
    for chunk in model:
        chunk.train()
    return total


def peak_memory_mb(cpu: bool) -> float:
    """Peak memory of this rank so far, MiB (high-water mark since the process started).

    GPU: ``torch.cuda.max_memory_allocated`` (tensors through the caching allocator).
    CPU (``cpu=True``): the process's peak resident set size (``getrusage`` ``ru_maxrss``,
    KiB on Linux): everything the process ever held at once, interpreter, libraries
    and model included; it never goes down.
    """
    if not cpu:
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_source(cpu: bool) -> str:
    """What :func:`peak_memory_mb` measures: ``cuda_max_allocated`` or ``ru_maxrss``."""
    return "ru_maxrss" if cpu else "cuda_max_allocated"
