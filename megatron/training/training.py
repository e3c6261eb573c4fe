"""The training loop: setup, steps, logging, evaluation, checkpoints, preemption.

:func:`pretrain` is what ``pretrain_gpt.py`` runs. Only rank 0 prints; every
step all-gathers one small float row from every rank (loss, compute times, attention
pairs, and the measured forward/backward time of each of its ops; see ``_ROW``), so
every rank knows the measured ``[dp][microbatch][stage]`` op times (the DST
predictor's recalibration input, identical everywhere) and rank 0 can report the
global loss, per-stage times, bubbles, micro-batch imbalance and density.

With a predictor (``--sb-profile`` / ``--sb-cost-model``) each step is also planned
and predicted by :class:`megatron.training.balance.Balancer` (DST budgets with
``--sb-dst``). ``--summary-json`` gets the metrics of :meth:`_Logger._balance_metrics`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch

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

    @property
    def density(self) -> float:
        """Achieved attention density of the step (1.0 when dense / unrecorded)."""
        return self.kept_pairs / self.causal_pairs if self.causal_pairs else 1.0


class SignalFlag:
    """SIGTERM / SIGUSR1 set a flag; the loop checks it between steps on all ranks."""

    def __init__(self, enabled: bool) -> None:
        self.raised = False
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.raised = True

    def any_rank(self) -> bool:
        """True if any rank got the signal (one all-reduce of a scalar)."""
        t = torch.tensor([1.0 if self.raised else 0.0], device=_comm_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _comm_device() -> torch.device:
    """Where small control tensors live: NCCL only moves CUDA tensors, gloo CPU ones."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_rows(row: List[float]) -> np.ndarray:
    """[world, len(row)] float64 table of every rank's row."""
    t = torch.tensor(row, dtype=torch.float64, device=_comm_device())
    out = [torch.zeros_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return torch.stack(out).cpu().numpy()


_ROW = ("loss_sum", "loss_tokens", "fwd_s", "bwd_s", "pp_rank", "dp_rank", "step_s",
        "kept_pairs", "causal_pairs", "peak_mb")
"""Fixed head of the per-step row every rank contributes; then per-op ms
``fwd[vpp, M]`` and ``bwd[vpp, M]`` (see :func:`_step_row`)."""
_COL = {name: i for i, name in enumerate(_ROW)}


def _stage_times(table: np.ndarray, col: int) -> List[float]:
    """Max over DP ranks of column ``col`` for each pipeline stage."""
    stages = table[:, _COL["pp_rank"]].astype(int)
    return [float(table[stages == s, col].max()) for s in range(int(stages.max()) + 1)]


def _step_row(args, result, step_s: float, pp_rank: int, dp_rank: int) -> List[float]:
    """This rank's row of the per-step gather (``_ROW`` + per-op forward/backward ms)."""
    from megatron.training.balance import op_times

    vpp = args.virtual_pipeline_model_parallel_size or 1
    M, pp = args.num_microbatches, args.pipeline_model_parallel_size
    calls = result.stage_times
    fwd = op_times(calls.get("forward-compute", []), "F", pp, pp_rank, M, vpp)
    bwd = op_times(calls.get("backward-compute", []), "B", pp, pp_rank, M, vpp)
    recs = result.attention_records
    head = [result.loss_sum, result.loss_tokens, fwd.sum() / 1e3, bwd.sum() / 1e3, float(pp_rank),
            float(dp_rank), step_s, float(sum(r.kept_pairs for r in recs)),
            float(sum(r.causal_pairs for r in recs)), float(result.peak_memory_mb)]
    return head + fwd.reshape(-1).tolist() + bwd.reshape(-1).tolist()


def _measured_ops(args, table: np.ndarray) -> tuple:
    """Measured forward/backward ms ``[dp, M, S]`` (S = virtual stages) from the table."""
    vpp = args.virtual_pipeline_model_parallel_size or 1
    M, pp, dp = args.num_microbatches, args.pipeline_model_parallel_size, args.data_parallel_size
    fwd, bwd = np.zeros((dp, M, pp * vpp)), np.zeros((dp, M, pp * vpp))
    n = len(_ROW)
    for row in table:
        d, r = int(row[_COL["dp_rank"]]), int(row[_COL["pp_rank"]])
        f = row[n:n + vpp * M].reshape(vpp, M)
        b = row[n + vpp * M:n + 2 * vpp * M].reshape(vpp, M)
        for c in range(vpp):  # tensor-parallel peers measure the same op: keep the slowest
            fwd[d, :, c * pp + r] = np.maximum(fwd[d, :, c * pp + r], f[c])
            bwd[d, :, c * pp + r] = np.maximum(bwd[d, :, c * pp + r], b[c])
    return fwd, bwd


def _bubbles(args, table: np.ndarray) -> List[float]:
    """Per pipeline rank: 1 - busy / step time, mean over the ranks holding that stage."""
    busy = table[:, _COL["fwd_s"]] + table[:, _COL["bwd_s"]]
    frac = 1.0 - busy / np.maximum(table[:, _COL["step_s"]], 1e-12)
    stages = table[:, _COL["pp_rank"]].astype(int)
    return [float(frac[stages == s].mean()) for s in range(args.pipeline_model_parallel_size)]


def _rank0_warn() -> Callable[[str], None]:
    """Prints ``pretrain_gpt.py: warning: ...`` on rank 0; a no-op elsewhere."""
    if torch.distributed.get_rank() != 0:
        return lambda m: None
    return lambda m: print(f"pretrain_gpt.py: warning: {m}", file=sys.stderr, flush=True)


def setup(args):
    """Initialise distributed state and build model, optimizer, scheduler, data loaders."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.training import data as D
    from megatron.training import initialize as init
    from megatron.training import model as M
    from megatron.training.indexed_io import open_loss_starts
    from megatron.training.step import StageTimers
    from megatron.training.data_sources import open_data
    from megatron.training.tokenizer import args_vocab_size, padded_vocab_size

    from megatron.training import balance as B

    init.initialize(args)
    cpu = init.use_cpu(args)
    vocab = padded_vocab_size(args_vocab_size(args), args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    dataset = open_data(args)
    loss_starts = open_loss_starts(args.data_path, dataset.sequence_lengths) if args.mask_prompt_loss else None
    train_ids, valid_ids, _ = D.split_documents(len(dataset), args.split_fractions)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    pad_to = args.seq_length if interleaved else None  # see megatron/training/data.py
    cp = dict(cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank())
    predictor = balancer = sampler_predictor = None
    if args.sb_has_predictor:
        predictor = B.build_predictor(args, vocab, warn=_rank0_warn())
        balancer = B.Balancer(args, predictor, pad_to)
        if args.sb_batching in ("sab", "wlb"):
            # Its own instance: the packer's costs never see the online correction, so
            # the data order stays a function of (seed, step) (see balance.py).
            sampler_predictor = B.build_predictor(args, vocab)
    loader = D.PackedDataLoader(dataset, train_ids, dp=dp, dp_rank=dp_rank,
                                micro_batches=args.num_microbatches, seq_length=args.seq_length,
                                strategy=args.sb_batching, seed=args.seed, vocab_size=vocab, pad_to=pad_to,
                                max_carry_steps=args.max_carry_steps, predictor=sampler_predictor,
                                pp=pp, pp_rank=pp_rank, loss_starts=loss_starts, **cp)
    valid = None
    if args.eval_interval and args.eval_iters and len(valid_ids):
        valid = D.PackedDataLoader(dataset, valid_ids, dp=dp, dp_rank=dp_rank,
                                   micro_batches=args.num_microbatches, seq_length=args.seq_length,
                                   strategy="megatron", seed=args.seed, shuffle=False, vocab_size=vocab,
                                   pad_to=pad_to, loss_starts=loss_starts, **cp)
    config = M.transformer_config(args, use_cpu=cpu)
    timers = StageTimers()
    config.timers = timers
    config.finalize_model_grads_func = finalize_model_grads
    model = M.build_model(args, config, vocab)
    optimizer, scheduler = M.build_optimizer(args, model)
    return dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, valid=valid,
                timers=timers, cpu=cpu, config=config, balancer=balancer)


def pretrain(args, on_step: Optional[Callable] = None) -> dict:
    """Train per ``args``; returns the summary dict (on every rank).

    Args:
        on_step: called as ``on_step(iteration, state, result)`` after every step on
            every rank (``state`` is :func:`setup`'s dict, ``result`` the
            :class:`~megatron.training.step.StepResult`); for tests and tools.
    """
    from megatron.training import checkpointing as ckpt
    from megatron.training.watchdog import start_watchdog

    state = setup(args)
    model, optimizer, scheduler, loader = (state[k] for k in ("model", "optimizer", "scheduler", "loader"))
    rank = torch.distributed.get_rank()
    warn = _rank0_warn()
    iteration = 0
    if args.load is not None and ckpt.read_tracker(args.load) is not None:
        if args.finetune:
            ckpt.load_weights(args.load, model, warn=warn)
        else:
            iteration = ckpt.load_checkpoint(args.load, model, optimizer, scheduler, loader, warn=warn,
                                             balancer=state["balancer"], load_optim=not args.no_load_optim)
    log = _Logger(args, rank, start=iteration)
    if args.sparse_attention:
        from megatron.training.balance import attention_backend

        log.info(f"sparse attention backend: {attention_backend(args)} "
                 f"(--sb-attention-backend {args.sb_attention_backend})")
    flag = SignalFlag(args.exit_signal_handler)
    timeline = _Timeline(args, rank) if args.sb_timeline else None
    # --step-timeout-minutes: from the first step on (setup and loading are not watched)
    state["watchdog"] = watchdog = start_watchdog(args.step_timeout_minutes)
    try:
        summary = _train_loop(args, state, iteration, on_step, log, warn, flag, timeline)
    except BaseException:
        if watchdog is not None:  # quietly: the store may have died with a peer
            watchdog.stop(done=False)
        raise
    if watchdog is not None:
        watchdog.stop()
    return summary


def _train_loop(args, state, iteration, on_step, log, warn, flag, timeline) -> dict:
    """The steps of :func:`pretrain` from ``iteration`` on, its saves and its summary."""
    from megatron.core import parallel_state as ps
    from megatron.training.failsafe import check_step_finite, should_exit
    from megatron.training.step import evaluate, train_step

    model, optimizer, scheduler, loader = (state[k] for k in ("model", "optimizer", "scheduler", "loader"))
    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    balancer, watchdog = state["balancer"], state["watchdog"]
    start, preempted, started = iteration, False, time.time()
    while iteration < args.train_iters:
        if watchdog is not None:
            watchdog.mark(f"step {iteration + 1}")
        t0 = time.perf_counter()
        batches = loader.next_step()
        forecast = balancer.forecast(batches) if balancer is not None else None
        if balancer is not None and balancer.ahead and iteration + 1 < args.train_iters:
            balancer.plan_ahead(loader.peek())
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this step applies
        result = train_step(args, model, optimizer, scheduler, batches, state["timers"])
        result.budget = batches.budget
        step_s = time.perf_counter() - t0
        iteration += 1
        table = _gather_rows(_step_row(args, result, step_s, pp_rank, dp_rank))
        meas_fwd, meas_bwd = _measured_ops(args, table)
        if balancer is not None:  # same table on every rank -> same correction everywhere
            balancer.observe(forecast, meas_fwd, meas_bwd)
        mb_ms = (meas_fwd + meas_bwd).sum(axis=2)
        tokens_in_loss = table[:, _COL["loss_tokens"]].sum()
        entry = StepLog(
            iteration=iteration,
            loss=float(table[:, _COL["loss_sum"]].sum() / max(tokens_in_loss, 1.0)),
            lr=lr,
            grad_norm=float(result.grad_norm or 0.0),
            step_s=step_s,
            tokens=batches.global_tokens,
            stage_fwd_s=_stage_times(table, _COL["fwd_s"]),
            stage_bwd_s=_stage_times(table, _COL["bwd_s"]),
            pack_ms=float(batches.plan.pack_ms),
            plan_ms=forecast.plan_ms if forecast else 0.0,
            plan_wait_ms=forecast.wait_ms if forecast else 0.0,
            predicted_step_ms=forecast.step_ms if forecast else None,
            imbalance=float(mb_ms.max() / mb_ms.mean()) if mb_ms.mean() > 0 else 1.0,
            bubble=_bubbles(args, table),
            kept_pairs=float(table[:, _COL["kept_pairs"]].sum()),
            causal_pairs=float(table[:, _COL["causal_pairs"]].sum()),
            static_density=_static_density(args, batches),
            peak_memory_mb=table[:, _COL["peak_mb"]].tolist(),
        )
        log.step(entry)
        check_step_finite(args, iteration, entry.loss, result.grad_norm)  # before eval / save
        if timeline is not None and iteration % args.log_interval == 0:
            timeline.write(iteration, forecast, meas_fwd, meas_bwd)
        if on_step is not None:
            on_step(iteration, state, result)
        if state["valid"] is not None and iteration % args.eval_interval == 0:
            if watchdog is not None:
                watchdog.mark(f"evaluation at iteration {iteration}")
            r = evaluate(args, model, state["valid"], args.eval_iters)
            state["timers"].pop()  # evaluation forwards are not training ops
            row = _gather_rows([r.loss_sum, r.loss_tokens])
            log.eval(iteration, float(row[:, 0].sum() / max(row[:, 1].sum(), 1.0)))
        if args.save and args.save_interval and iteration % args.save_interval == 0 \
                and iteration < args.train_iters:
            _save(args, iteration, state, log, warn, last=False)
        if args.exit_signal_handler and flag.any_rank():
            preempted = iteration < args.train_iters
            break
        stop = should_exit(args, iteration, started)
        if stop is not None and iteration < args.train_iters:
            log.info(f"stopping after iteration {iteration} ({stop})")
            break
    if args.save and iteration > start:  # nothing new to save if no step ran
        _save(args, iteration, state, log, warn, last=True)
    if timeline is not None:
        timeline.finish()
    summary = log.summary(preempted)
    return summary


def _save(args, iteration: int, state: dict, log: "_Logger", warn: Callable[[str], None], last: bool) -> None:
    """Save a checkpoint (all ranks), then apply ``--keep-last`` (rank 0).

    A failed save raises its one-line :class:`~megatron.training.checkpointing.SaveError`
    (exit 1), or with ``--continue-on-save-failure`` warns and returns, except for the
    ``last`` save of the run (end or preemption): nothing follows that could make up for it.
    """
    from megatron.training import checkpointing as ckpt

    model, optimizer, scheduler, loader = (state[k] for k in ("model", "optimizer", "scheduler", "loader"))
    if state.get("watchdog") is not None:
        state["watchdog"].mark(f"checkpoint save at iteration {iteration}")
    try:
        ckpt.save_checkpoint(args.save, iteration, model, optimizer, scheduler, loader, state["cpu"],
                             balancer=state["balancer"], save_optim=not args.no_save_optim)
    except ckpt.SaveError as e:
        if last or not args.continue_on_save_failure:
            raise
        warn(f"{e}; training continues (--continue-on-save-failure)")
        return
    log.info(f"saved checkpoint at iteration {iteration} to {args.save}")
    if args.keep_last and torch.distributed.get_rank() == 0:
        try:
            removed = ckpt.remove_old_checkpoints(args.save, args.keep_last, newest=iteration)
        except OSError as e:  # a checkpoint left behind costs disk, not correctness
            warn(f"--keep-last: could not remove old checkpoints in {args.save}: {e}")
            return
        if removed:
            log.info(f"removed {', '.join(removed)} (--keep-last {args.keep_last})")


def _retained_vs_static(steps: List[StepLog], density: float) -> Optional[float]:
    """Measured density over the run / the static top-k's density on the same
    documents (weighted by causal pairs like the measured one); 1.0 = static."""
    pairs = [(s.static_density, s.causal_pairs) for s in steps if s.static_density is not None]
    weight = sum(c for _, c in pairs)
    if not pairs or weight <= 0:
        return None
    static = sum(d * c for d, c in pairs) / weight
    return density / static if static > 0 else None


class _Timeline:
    """``--sb-timeline DIR``: per logged step, ``step_<iter>.predicted.json`` and
    ``step_<iter>.measured.json`` (tools/timeline.py format, every DP replica and
    (virtual) stage in one file); at the end a Gantt PNG of the last one. Rank 0 only."""

    def __init__(self, args, rank: int) -> None:
        self.dir, self.rank = args.sb_timeline, rank
        self.vpp = args.virtual_pipeline_model_parallel_size or 1
        self.schedule = "interleaved" if self.vpp > 1 else "1f1b"
        self.last = None
        if rank == 0:
            os.makedirs(self.dir, exist_ok=True)

    def _doc(self, fwd, bwd) -> dict:
        return {"schedule": self.schedule, "vpp": self.vpp, "p2p_ms": 0.0,
                "fwd_ms": np.asarray(fwd).tolist(), "bwd_ms": np.asarray(bwd).tolist()}

    def write(self, iteration: int, forecast, meas_fwd, meas_bwd) -> None:
        if self.rank != 0 or forecast is None:
            return
        for kind, f, b in (("predicted", forecast.fwd_ms, forecast.bwd_ms),
                           ("measured", meas_fwd, meas_bwd)):
            doc = self._doc(f, b)
            if forecast.budget is not None:  # DST's top-k per [dp, microbatch, stage]
                doc["budget"] = np.asarray(forecast.budget).tolist()
            _atomic_json(os.path.join(self.dir, f"step_{iteration:07d}.{kind}.json"), doc)
        self.last = (iteration, forecast.fwd_ms, forecast.bwd_ms, meas_fwd, meas_bwd)

    def finish(self) -> None:
        if self.rank != 0 or self.last is None:
            return
        from sparsebalance.pipeline import simulate
        from sparsebalance.pipeline.trace import write_gantt

        it, pf, pb, mf, mb = self.last
        sim = lambda f, b: simulate(f, b, schedule=self.schedule, vpp=self.vpp)
        write_gantt(os.path.join(self.dir, f"step_{it:07d}.png"),
                    {"predicted": sim(pf, pb), "measured": sim(mf, mb)},
                    title=f"iteration {it}: predicted vs measured op times (megatron op order)")


def _static_density(args, batches) -> Optional[float]:
    """Density of the step's whole global batch at the static top-k (the baseline that
    DST's retained attention is compared with, on the same documents)."""
    if not args.sparse_attention or batches.plan is None:
        return None
    from megatron.training.data import microbatch_lengths
    from sparsebalance.attention.routing import density

    pad_to = args.seq_length if args.virtual_pipeline_model_parallel_size is not None else None
    return density([n for rank in batches.plan.ranks for mb in rank
                    for n in microbatch_lengths(mb, pad_to)], args.sb_topk, args.sb_block_size)


def _atomic_json(path: str, obj) -> None:
    """Write strict JSON (non-finite floats as null) atomically (``sparsebalance.io``)."""
    atomic_write_text(path, strict_json(obj))


def _warmup_steps(n: int) -> int:
    """Steps skipped by the timing medians: max(2, 10%), but never all of them."""
    skip = max(2, n // 10)
    return skip if n > skip else 0


_PEAK_RANKS_SHOWN = 16
"""Log lines list every rank's peak memory up to this many ranks, else the max and its rank."""


def _peak_memory_text(peaks: List[float]) -> str:
    """``peak mem MB [r0 r1 ...]`` for the log line (``peak mem MB max X (rank r)`` on
    large worlds)."""
    if len(peaks) <= _PEAK_RANKS_SHOWN:
        return "peak mem MB [" + " ".join(f"{p:.0f}" for p in peaks) + "]"
    r = int(np.argmax(peaks))
    return f"peak mem MB max {peaks[r]:.0f} (rank {r})"


class _Logger:
    """Rank-0 console (tqdm bar + log lines), tensorboard and the final summary."""

    def __init__(self, args, rank: int, start: int) -> None:
        self.args, self.rank, self.start = args, rank, start
        self.steps: List[StepLog] = []
        self.bar = None
        self.tb = None
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

    def step(self, s: StepLog) -> None:
        self.steps.append(s)
        if self.rank != 0:
            return
        tps = s.tokens / s.step_s if s.step_s > 0 else 0.0
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{s.loss:.4f}", tok_s=f"{tps:.0f}")
        if s.iteration % self.args.log_interval == 0:
            fwd = " ".join(f"{t * 1e3:.0f}" for t in s.stage_fwd_s)
            bwd = " ".join(f"{t * 1e3:.0f}" for t in s.stage_bwd_s)
            extra = ""
            if self.args.sparse_attention:
                extra += f" | density {s.density:.3f}"
            if s.predicted_step_ms is not None:
                extra += (f" | predicted {s.predicted_step_ms:.1f} ms | plan {s.plan_ms:.1f} ms"
                          f" (waited {s.plan_wait_ms:.1f})")
            bub = " ".join(f"{b:.2f}" for b in s.bubble)
            self.info(f"iter {s.iteration:6d}/{self.args.train_iters} | loss {s.loss:.4f} | lr {s.lr:.3e} | "
                      f"grad-norm {s.grad_norm:.3f} | step {s.step_s * 1e3:.0f} ms | "
                      f"tokens/s {tps:.0f} | fwd ms/stage [{fwd}] | bwd ms/stage [{bwd}] | "
                      f"bubble [{bub}] | imbalance {s.imbalance:.2f} | pack {s.pack_ms:.1f} ms | "
                      f"{_peak_memory_text(s.peak_memory_mb)}{extra}")
        if self.tb is not None:
            for name, value in (("loss", s.loss), ("lr", s.lr), ("grad-norm", s.grad_norm),
                                ("step-time-s", s.step_s), ("tokens-per-s", tps),
                                ("imbalance", s.imbalance), ("density", s.density),
                                ("pack-ms", s.pack_ms), ("plan-ms", s.plan_ms),
                                ("peak-memory-mb", max(s.peak_memory_mb, default=0.0))):
                self.tb.add_scalar(name, value, s.iteration)
            for i, (f, b) in enumerate(zip(s.stage_fwd_s, s.stage_bwd_s)):
                self.tb.add_scalar(f"stage{i}/fwd-s", f, s.iteration)
                self.tb.add_scalar(f"stage{i}/bwd-s", b, s.iteration)

    def eval(self, iteration: int, loss: float) -> None:
        self.info(f"iter {iteration:6d} | validation loss {loss:.4f}")
        if self.tb is not None:
            self.tb.add_scalar("validation-loss", loss, iteration)

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
            "preempted": preempted,
        }
        out.update(self._balance_metrics())
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
                _atomic_json(self.args.summary_json, out)
        return out

    def _balance_metrics(self) -> dict:
        """The evaluation tool's metrics (see pretrain_gpt.py --summary-json). Timing
        metrics skip the warm-up steps (:func:`_warmup_steps`); density and losses use
        every step of this run."""
        from megatron.training.balance import attention_backend
        from megatron.training.initialize import use_cpu
        from megatron.training.step import peak_memory_source

        steps = self.steps
        counted = steps[_warmup_steps(len(steps)):]
        med = lambda xs: float(np.median(xs)) if len(xs) else None
        t_s = sum(s.step_s for s in counted)
        kept, causal = sum(s.kept_pairs for s in steps), sum(s.causal_pairs for s in steps)
        preds = [s.predicted_step_ms for s in counted if s.predicted_step_ms is not None]
        bubbles = np.array([s.bubble for s in counted]) if counted else np.zeros((0, 0))
        # per rank, the largest high-water mark seen over the run (MB = 2**20 bytes)
        peaks = np.max([s.peak_memory_mb for s in steps], axis=0) if steps else np.zeros(0)
        keys = ("sparse_attention", "sparse_balance", "sb_batching", "max_carry_steps", "sb_dst",
                "sb_anchor", "sb_p", "sb_topk", "sb_topk_min", "sb_topk_max", "sb_attn_slack",
                "sb_block_size", "sb_attention_backend", "sb_profile", "sb_cost_model",
                "sb_allow_stale_profile", "num_layers", "hidden_size", "num_attention_heads",
                "seq_length", "global_batch_size", "num_microbatches", "data_parallel_size",
                "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "tensor_model_parallel_size", "seed", "train_iters", "data_path", "mask_prompt_loss",
                "finetune", "load", "recompute_granularity", "recompute_method", "recompute_num_layers")
        return {
            "step_ms_median": med([s.step_s * 1e3 for s in counted]),
            "step_ms_all": [s.step_s * 1e3 for s in steps],
            "step_tokens_all": [int(s.tokens) for s in steps],
            "warmup_steps_skipped": len(steps) - len(counted),
            "tokens_per_s": float(sum(s.tokens for s in counted) / t_s) if t_s > 0 else 0.0,
            "loss_first": steps[0].loss if steps else None,
            "loss_last": steps[-1].loss if steps else None,
            "density_mean": kept / causal if causal else 1.0,
            "retained_vs_static": _retained_vs_static(steps, kept / causal if causal else 1.0),
            "imbalance_mean": float(np.mean([s.imbalance for s in counted])) if counted else None,
            "bubble_fraction": bubbles.mean(axis=0).tolist() if len(counted) else [],
            "predicted_step_ms_median": med(preds) if preds else None,
            "pack_ms_median": med([s.pack_ms for s in counted]),
            "plan_ms_median": med([s.plan_ms for s in counted]) if preds else None,
            "plan_wait_ms_median": med([s.plan_wait_ms for s in counted]) if preds else None,
            "attention_backend": attention_backend(self.args),
            "peak_memory_mb": peaks.tolist(),
            "peak_memory_mb_max": float(peaks.max()) if len(peaks) else None,
            "peak_memory_source": peak_memory_source(use_cpu(self.args)),
            "args": {k: getattr(self.args, k, None) for k in keys},
        }
