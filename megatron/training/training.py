"""The training loop: setup, steps, logging, evaluation, checkpoints, preemption.

:func:`pretrain` is what ``pretrain_gpt.py`` runs. :func:`setup` builds the run's
:class:`TrainState`; the loop runs :func:`megatron.training.step.train_step` per step
and all-gathers every rank's :class:`~megatron.training.step_metrics.RankStep` (the
measured op times feed the DST predictor's recalibration, identical on every rank).
Only rank 0 prints (:class:`~megatron.training.run_log.RunLogger`).

The library decides each step in one call (the loader's
:class:`sparsebalance.balancer.StepPlanner`: packing and, with a predictor, the plan of
:class:`sparsebalance.balancer.Balancer`, DST budgets with ``--sb-dst``, whose table the
step's data iterators hand out per micro-batch) and hears what it measured in another
(``Balancer.observe``). ``--summary-json`` gets the metrics
of :meth:`RunLogger._balance_metrics`. After :func:`setup` builds the run's
:class:`~sparsebalance.config.SparseBalanceConfig` (``TrainState.sb``), the ``--sb-*``
settings are read from it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from megatron.training import pipeline_layout
from megatron.training.failsafe import strict_json
from megatron.training.preflight import run_settings
from megatron.training.run_log import RunLogger, StepLog, kernel_compiles_by_kind
from megatron.training.step_metrics import GatheredStep, RankStep, comm_device, gather_floats, rank_step_row
from sparsebalance.io import atomic_write_text


@dataclass
class TrainState:
    """Everything a run holds between steps (built by :func:`setup`)."""

    model: List[torch.nn.Module]
    """Model chunks of this rank (one per virtual stage)."""
    optimizer: Any
    """megatron-core optimizer."""
    scheduler: Any
    """megatron-core ``OptimizerParamScheduler``."""
    loader: Any
    """Training :class:`~megatron.training.data.PackedDataLoader`."""
    valid: Any
    """Validation loader (None: no evaluation)."""
    timers: Any
    """:class:`~megatron.training.step.StageTimers` the schedules call."""
    cpu: bool
    """The run trains on CPU."""
    config: Any
    """megatron-core ``TransformerConfig``."""
    sb: Any
    """The run's :class:`~sparsebalance.config.SparseBalanceConfig` (the library's view of
    the flags; the driver reads the ``--sb-*`` settings from it too)."""
    balancer: Any = None
    """:class:`~sparsebalance.balancer.Balancer` (None: no predictor)."""
    watchdog: Any = None
    """:class:`~megatron.training.watchdog.Watchdog` of ``--step-timeout-minutes`` (None: off)."""
    iteration: int = 0
    """Steps done (the loaded checkpoint's iteration at the start)."""

    def mark(self, what: str) -> None:
        """Tell the watchdog (if any) what the run does now."""
        if self.watchdog is not None:
            self.watchdog.mark(what)


@dataclass
class RunHooks:
    """The loop's outputs and controls besides the state."""

    log: RunLogger
    """Rank-0 console, tensorboard and summary."""
    warn: Callable[[str], None]
    """One-line warnings (rank 0)."""
    flag: "SignalFlag"
    """Preemption signal flag."""
    timeline: Optional["_Timeline"] = None
    """``--sb-timeline`` writer (None: off)."""
    on_step: Optional[Callable] = None
    """``on_step(iteration, state, result)`` after every step (tests and tools)."""


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
        t = torch.tensor([1.0 if self.raised else 0.0], device=comm_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _rank0_warn() -> Callable[[str], None]:
    """Prints ``pretrain_gpt.py: warning: ...`` on rank 0; a no-op elsewhere."""
    if torch.distributed.get_rank() != 0:
        return lambda m: None
    return lambda m: print(f"pretrain_gpt.py: warning: {m}", file=sys.stderr, flush=True)


def setup(args) -> TrainState:
    """Initialise distributed state and build model, optimizer, scheduler, data loaders."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from megatron.training.data import PackedDataLoader, split_documents
    from megatron.training.data_sources import open_data
    from megatron.training.indexed_io import open_loss_starts
    from megatron.training.initialize import initialize, use_cpu
    from megatron.training.model import build_model, build_optimizer, transformer_config
    from megatron.training.sb_config import sparsebalance_config
    from megatron.training.step import StageTimers
    from megatron.training.tokenizer import model_vocab_size
    from sparsebalance.balancer import Balancer, build_predictor
    from sparsebalance.batching.strategies import get_strategy
    from sparsebalance.pipeline import rank_order

    initialize(args)
    cpu = use_cpu(args)
    vocab = args.padded_vocab_size = model_vocab_size(args)  # saved in checkpoints' args
    dataset = open_data(args)
    if args.fim_data:
        from megatron.training.fim import FIMDocuments, fim_config
        from megatron.training.tokenizer import args_tokenizer

        tokenizer = args_tokenizer(args)
        dataset = FIMDocuments(dataset, tokenizer, fim_config(args, tokenizer))
    loss_starts = open_loss_starts(args.data_path, dataset.sequence_lengths) if args.mask_prompt_loss else None
    train_ids, valid_ids, _ = split_documents(len(dataset), args.split_fractions)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    pad_to = args.micro_batch_tokens if interleaved else None  # see megatron/training/data.py
    pad_id = args.null_tokenizer_pad_id if args.null_tokenizer_pad_id >= 0 else None
    if args.sb_auto_layout:  # before the model and the predictor see the split
        from megatron.training.sb_config import build_predictor as args_predictor

        line = pipeline_layout.apply_auto(args, args_predictor(args, vocab),
                                          np.asarray(dataset.sequence_lengths)[train_ids])
        if torch.distributed.get_rank() == 0:
            print(line, flush=True)
    sb = sparsebalance_config(args, vocab)  # the library's one view of the flags
    # how each micro-batch is split over CP ranks and padded for sequence parallelism
    cp = dict(cp=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(), sp=sb.parallel.sp)
    predictor = balancer = sampler_predictor = None
    if sb.predictor.enabled:
        predictor = build_predictor(sb, warn=_rank0_warn())
        balancer = Balancer(sb, predictor)
        if get_strategy(sb.packing.strategy).predictor != "none":  # raises on an unknown name
            # Its own instance: the packer's costs never see the online correction, so
            # the data order stays a function of (seed, step) (see sparsebalance/balancer.py).
            sampler_predictor = build_predictor(sb)
    density = None
    if sampler_predictor is not None or (balancer is not None and sb.dst.enabled):
        # threshold routing: SAB predicts each document's density, DST prices its TAU levels with it
        from megatron.training.doc_features import threshold_density

        density = threshold_density(sb, args.data_blend, dataset, train_ids)
    sensitivity = None
    if balancer is not None and sb.dst.enabled and sb.dst.sensitivity != "off":
        from megatron.training.doc_features import sensitivity_weights

        sensitivity = sensitivity_weights(sb, args.data_blend, dataset, train_ids)
    loader = PackedDataLoader(dataset, train_ids, dp=dp, dp_rank=dp_rank, item_length=args.seq_length,
                              micro_batches=args.num_microbatches, seq_length=args.micro_batch_tokens,
                              strategy=sb.packing.strategy, seed=args.seed, vocab_size=vocab, pad_to=pad_to,
                              max_carry_steps=sb.packing.max_carry_steps, predictor=sampler_predictor,
                              pp=pp, pp_rank=pp_rank, loss_starts=loss_starts, pad_id=pad_id,
                              balancer=balancer, attention=sb.attention, density=density,
                              sensitivity=sensitivity, **cp)
    valid = None
    if args.eval_interval and args.eval_iters > 0 and len(valid_ids):
        valid = PackedDataLoader(dataset, valid_ids, dp=dp, dp_rank=dp_rank, item_length=args.seq_length,
                                 micro_batches=args.eval_num_microbatches, seq_length=args.micro_batch_tokens,
                                 strategy="megatron", seed=args.seed, shuffle=False, vocab_size=vocab,
                                 pad_to=pad_to, loss_starts=loss_starts, pad_id=pad_id, **cp)
    config = transformer_config(args, use_cpu=cpu)
    timers = StageTimers(rank_order(sb.parallel.schedule, pp, pp_rank, args.num_microbatches,
                                    sb.parallel.vpp, sb.parallel.group))
    config.timers = timers
    config.finalize_model_grads_func = finalize_model_grads
    model = build_model(args, config, vocab, sb.attention)
    optimizer, scheduler = build_optimizer(args, model)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, valid=valid,
                      timers=timers, cpu=cpu, config=config, sb=sb, balancer=balancer)


def pretrain(args, on_step: Optional[Callable] = None) -> dict:
    """Train per ``args``; returns the summary dict (on every rank).

    Args:
        on_step: called as ``on_step(iteration, state, result)`` after every step on
            every rank (``state`` is the :class:`TrainState`, ``result`` the
            :class:`~megatron.training.step.StepResult`); for tests and tools.
    """
    from megatron.training import checkpointing as ckpt
    from megatron.training.checkpoint_args import saved_args
    from megatron.training.watchdog import start_watchdog

    state = setup(args)
    rank = torch.distributed.get_rank()
    warn = _rank0_warn()
    if args.load is not None and ckpt.read_tracker(args.load) is not None:
        if args.finetune:
            ckpt.load_weights(args.load, state.model, warn=warn)
        else:
            state.iteration = ckpt.load_checkpoint(args.load, state.model, state.optimizer, state.scheduler,
                                                   state.loader, warn=warn, balancer=state.balancer,
                                                   load_optim=not args.no_load_optim,
                                                   settings=run_settings(args), split=pipeline_layout.record(args),
                                                   model_args=saved_args(args))
    log = RunLogger(args, rank, state.sb, start=state.iteration)
    if state.sb.attention.sparse:
        choice = log.attention_backend()
        log.info(f"sparse attention backend: {choice['backend']} ({choice['reason']})")
    hooks = RunHooks(log=log, warn=warn, flag=SignalFlag(args.exit_signal_handler),
                     timeline=_Timeline(args, rank) if args.sb_timeline else None, on_step=on_step)
    # --step-timeout-minutes: from the first step on (setup and loading are not watched)
    state.watchdog = start_watchdog(args.step_timeout_minutes)
    try:
        summary = _train_loop(args, state, hooks)
    except BaseException:
        if state.watchdog is not None:  # quietly: the store may have died with a peer
            state.watchdog.stop(done=False)
        raise
    if state.watchdog is not None:
        state.watchdog.stop()
    return summary


def _train_loop(args, state: TrainState, hooks: RunHooks) -> dict:
    """The steps of :func:`pretrain` from ``state.iteration`` on, its saves and its summary."""
    from megatron.core import parallel_state as ps

    from megatron.training.failsafe import check_step_finite, should_exit
    from megatron.training.profiling import StepProfiler
    from megatron.training.rerun import RerunConfig, ResultValidator
    from megatron.training.step import evaluate, train_step

    pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    balancer, loader = state.balancer, state.loader
    start, preempted, started = state.iteration, False, time.time()
    profiler = StepProfiler(args, torch.distributed.get_rank())
    hash_every = args.check_weight_hash_across_dp_replicas_interval
    validator = ResultValidator(RerunConfig(args.rerun_mode, args.error_injection_rate, args.error_injection_type,
                                            args.seed), torch.distributed.get_rank(), _rank0_warn())
    if hash_every:
        from megatron.training.replica_check import check_weight_hashes

        check_weight_hashes(state.model, state.iteration)
    while state.iteration < args.train_iters:
        state.mark(f"step {state.iteration + 1}")
        profiled = profiler.before_step(state.iteration)
        t0 = time.perf_counter()
        batches = loader.next_step(more=state.iteration + 1 < args.train_iters)
        forecast = batches.planned.forecast
        # the rate this step applies (as Megatron-LM logs it: a group on the --lr schedule,
        # not the --decoupled-lr one of the embedding and output layer)
        groups = state.optimizer.param_groups
        lr = float(next((g for g in groups if g.get("default_config", True)), groups[0])["lr"])
        result = train_step(args, state.model, state.optimizer, state.scheduler, batches, state.timers,
                            validator if validator.enabled else None, state.iteration + 1)
        result.budget, result.tau = batches.budget, batches.tau
        step_s = time.perf_counter() - t0
        state.iteration += 1
        gathered = _gather_step(args, result, step_s, pp_rank, dp_rank)
        meas_fwd, meas_bwd = gathered.measured_ops()
        if balancer is not None:  # same table on every rank -> same correction everywhere
            balancer.observe(forecast, meas_fwd, meas_bwd)
        if loader.density is not None:  # same per-segment pairs on every rank (all-reduced)
            from megatron.training.doc_features import feedback

            feedback(loader.density, batches.packing, dp_rank, result.attention_records)
        entry = _step_log(args, state.iteration, lr, step_s, batches, result, forecast, gathered,
                          (meas_fwd + meas_bwd).sum(axis=2))
        entry.profiled = profiled
        hooks.log.step(entry)
        profiler.after_step(state.iteration, hooks.log)
        check_step_finite(args, state.iteration, entry.loss, result.grad_norm)  # before eval / save
        if hash_every and state.iteration % hash_every == 0:
            check_weight_hashes(state.model, state.iteration)
        if hooks.timeline is not None and state.iteration % args.log_interval == 0:
            hooks.timeline.write(state.iteration, forecast, meas_fwd, meas_bwd)
        if hooks.on_step is not None:
            hooks.on_step(state.iteration, state, result)
        if state.valid is not None and state.iteration % args.eval_interval == 0 \
                and state.iteration >= (args.start_eval_at_iter or 0):
            state.mark(f"evaluation at iteration {state.iteration}")
            r = evaluate(args, state.model, state.valid, args.eval_iters)
            state.timers.pop()  # evaluation forwards are not training ops
            row = gather_floats([r.loss_sum, r.loss_tokens])
            hooks.log.eval(state.iteration, float(row[:, 0].sum() / max(row[:, 1].sum(), 1.0)))
        if args.save and args.save_interval and state.iteration % args.save_interval == 0 \
                and state.iteration < args.train_iters:
            _save(args, state, hooks, last=False)
        if args.exit_signal_handler and hooks.flag.any_rank():
            preempted = state.iteration < args.train_iters
            break
        stop = should_exit(args, state.iteration, started)
        if stop is not None and state.iteration < args.train_iters:
            hooks.log.info(f"stopping after iteration {state.iteration} ({stop})")
            break
    profiler.stop(state.iteration, hooks.log)  # a run that stopped inside the window
    hooks.log.profile = profiler.result
    if args.save and state.iteration > start:  # nothing new to save if no step ran
        _save(args, state, hooks, last=True)
    if hooks.timeline is not None:
        hooks.timeline.finish()
    return hooks.log.summary(preempted)


def _gather_step(args, result, step_s: float, pp_rank: int, dp_rank: int) -> GatheredStep:
    """Every rank's measurements of the step just run (one all-gather)."""
    vpp = args.virtual_pipeline_model_parallel_size or 1
    M, pp = args.num_microbatches, args.pipeline_model_parallel_size
    fwd, bwd = result.op_ms
    recs = result.attention_records
    mine = RankStep(loss_sum=result.loss_sum, loss_tokens=result.loss_tokens, fwd_s=fwd.sum() / 1e3,
                    bwd_s=bwd.sum() / 1e3, pp_rank=pp_rank, dp_rank=dp_rank, step_s=step_s,
                    kept_pairs=float(sum(r.kept_pairs for r in recs)),
                    causal_pairs=float(sum(r.causal_pairs for r in recs)),
                    peak_mb=float(result.peak_memory_mb))
    return GatheredStep(gather_floats(rank_step_row(mine, fwd, bwd)), pp=pp, dp=args.data_parallel_size,
                        vpp=vpp, microbatches=M)


def _step_log(args, iteration: int, lr: float, step_s: float, batches, result, forecast,
              gathered: GatheredStep, mb_ms: np.ndarray) -> StepLog:
    """Rank 0's record of one step (``mb_ms``: measured ms per ``[dp, microbatch]``)."""
    return StepLog(
        iteration=iteration,
        loss=gathered.loss(),
        lr=lr,
        grad_norm=float(result.grad_norm or 0.0),
        params_norm=result.params_norm,
        num_zeros_in_grad=None if result.num_zeros_in_grad is None else float(result.num_zeros_in_grad),
        step_s=step_s,
        tokens=batches.global_tokens,
        stage_fwd_s=gathered.stage_times("fwd_s"),
        stage_bwd_s=gathered.stage_times("bwd_s"),
        pack_ms=float(batches.packing.pack_ms),
        plan_ms=forecast.plan_ms if forecast else 0.0,
        plan_wait_ms=forecast.wait_ms if forecast else 0.0,
        predicted_step_ms=forecast.step_ms if forecast else None,
        imbalance=float(mb_ms.max() / mb_ms.mean()) if mb_ms.mean() > 0 else 1.0,
        bubble=gathered.bubbles(),
        kept_pairs=float(gathered.column("kept_pairs").sum()),
        causal_pairs=float(gathered.column("causal_pairs").sum()),
        static_density=batches.planned.static_density,
        peak_memory_mb=gathered.column("peak_mb").tolist(),
        compiles_by_kind=kernel_compiles_by_kind(),
    )


def _save(args, state: TrainState, hooks: RunHooks, last: bool) -> None:
    """Save a checkpoint (all ranks), then apply ``--keep-last`` (rank 0).

    A failed save raises its one-line :class:`~megatron.training.checkpointing.SaveError`
    (exit 1), or with ``--continue-on-save-failure`` warns and returns, except for the
    ``last`` save of the run (end or preemption): nothing follows that could make up for it.
    """
    from megatron.training import checkpointing as ckpt
    from megatron.training.checkpoint_args import saved_args

    iteration, log, warn = state.iteration, hooks.log, hooks.warn
    state.mark(f"checkpoint save at iteration {iteration}")
    previous = max((i for i in ckpt.list_iterations(args.save) if i < iteration), default=None) \
        if args.save_retain_interval else None
    try:
        ckpt.save_checkpoint(args.save, iteration, state.model, state.optimizer, state.scheduler,
                             state.loader, state.cpu, balancer=state.balancer,
                             save_optim=not args.no_save_optim, settings=run_settings(args),
                             model_args=saved_args(args), split=pipeline_layout.record(args),
                             metadata=ckpt.content_metadata(args.dist_ckpt_optim_fully_reshardable,
                                                            args.distrib_optim_fully_reshardable_mem_efficient))
    except ckpt.SaveError as e:
        if last or not args.continue_on_save_failure:
            raise
        warn(f"{e}; training continues (--continue-on-save-failure)")
        return
    log.info(f"saved checkpoint at iteration {iteration} to {args.save}")
    if previous is not None and previous % args.save_retain_interval and torch.distributed.get_rank() == 0:
        # Megatron-LM's --save-retain-interval: the checkpoint before this one goes unless retained
        try:
            ckpt.remove_checkpoint(args.save, previous)
            log.info(f"removed {os.path.basename(ckpt.iter_dir(args.save, previous))} "
                     f"(--save-retain-interval {args.save_retain_interval})")
        except OSError as e:  # a checkpoint left behind costs disk, not correctness
            warn(f"--save-retain-interval: could not remove {ckpt.iter_dir(args.save, previous)}: {e}")
    if args.keep_last and torch.distributed.get_rank() == 0:
        try:
            removed = ckpt.remove_old_checkpoints(args.save, args.keep_last, newest=iteration)
        except OSError as e:  # a checkpoint left behind costs disk, not correctness
            warn(f"--keep-last: could not remove old checkpoints in {args.save}: {e}")
            return
        if removed:
            log.info(f"removed {', '.join(removed)} (--keep-last {args.keep_last})")


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
            if forecast.tau is not None:  # DST's TAU per [dp, microbatch, stage] (threshold routing)
                doc["tau"] = np.asarray(forecast.tau).tolist()
            atomic_write_text(os.path.join(self.dir, f"step_{iteration:07d}.{kind}.json"), strict_json(doc))
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
