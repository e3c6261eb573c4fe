"""The training loop: setup, steps, logging, evaluation, checkpoints, preemption.

:func:`pretrain` is what ``pretrain_gpt.py`` runs. Only rank 0 prints; every
step gathers a tiny ``[loss_sum, loss_tokens, fwd_s, bwd_s]`` row from every rank
so rank 0 can report the global loss and per-stage compute times.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch


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
        t = torch.tensor([1.0 if self.raised else 0.0])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _gather_rows(row: List[float]) -> np.ndarray:
    """[world, len(row)] float64 table of every rank's row."""
    t = torch.tensor(row, dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return torch.stack(out).numpy()


def _stage_times(table: np.ndarray, col: int) -> List[float]:
    """Max over DP ranks of column ``col`` for each pipeline stage (column 4 holds
    each rank's pipeline rank)."""
    stages = table[:, 4].astype(int)
    return [float(table[stages == s, col].max()) for s in range(int(stages.max()) + 1)]


def setup(args):
    """Initialise distributed state and build model, optimizer, scheduler, data loaders."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.training import data as D
    from megatron.training import initialize as init
    from megatron.training import model as M
    from megatron.training.indexed_io import open_dataset
    from megatron.training.step import StageTimers
    from megatron.training.tokenizer import vocab_size_for

    init.initialize(args)
    cpu = init.use_cpu(args)
    vocab = vocab_size_for(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    dataset = open_dataset(args.data_path)
    train_ids, valid_ids, _ = D.split_documents(len(dataset), args.split_fractions)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    pad_to = args.seq_length if interleaved else None  # see megatron/training/data.py
    loader = D.PackedDataLoader(dataset, train_ids, dp=dp, dp_rank=dp_rank,
                                micro_batches=args.num_microbatches, seq_length=args.seq_length,
                                strategy=args.sb_batching, seed=args.seed, vocab_size=vocab, pad_to=pad_to)
    valid = None
    if args.eval_interval and args.eval_iters and len(valid_ids):
        valid = D.PackedDataLoader(dataset, valid_ids, dp=dp, dp_rank=dp_rank,
                                   micro_batches=args.num_microbatches, seq_length=args.seq_length,
                                   strategy="megatron", seed=args.seed, shuffle=False, vocab_size=vocab,
                                   pad_to=pad_to)
    config = M.transformer_config(args, use_cpu=cpu)
    timers = StageTimers()
    config.timers = timers
    config.finalize_model_grads_func = finalize_model_grads
    model = M.build_model(args, config, vocab)
    optimizer, scheduler = M.build_optimizer(args, model)
    return dict(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, valid=valid,
                timers=timers, cpu=cpu, config=config)


def pretrain(args, on_step: Optional[Callable] = None) -> dict:
    """Train per ``args``; returns the summary dict (on every rank).

    Args:
        on_step: called as ``on_step(iteration, state, result)`` after every step on
            every rank (``state`` is :func:`setup`'s dict, ``result`` the
            :class:`~megatron.training.step.StepResult`); for tests and tools.
    """
    from megatron.core import parallel_state as ps
    from megatron.training import checkpointing as ckpt
    from megatron.training.step import evaluate, train_step

    state = setup(args)
    model, optimizer, scheduler, loader = (state[k] for k in ("model", "optimizer", "scheduler", "loader"))
    rank = torch.distributed.get_rank()
    iteration = 0
    if args.load is not None and ckpt.read_tracker(args.load) is not None:
        if args.finetune:
            ckpt.load_weights(args.load, model)
        else:
            iteration = ckpt.load_checkpoint(args.load, model, optimizer, scheduler, loader)
    start = iteration
    log = _Logger(args, rank, start=iteration)
    flag = SignalFlag(args.exit_signal_handler)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    preempted = False
    while iteration < args.train_iters:
        t0 = time.perf_counter()
        batches = loader.next_step()
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this step applies
        result = train_step(args, model, optimizer, scheduler, batches, state["timers"])
        step_s = time.perf_counter() - t0
        iteration += 1
        times = result.stage_times
        table = _gather_rows([result.loss_sum, result.loss_tokens, times.get("forward-compute", 0.0),
                              times.get("backward-compute", 0.0), float(pp_rank)])
        tokens_in_loss = table[:, 1].sum()
        entry = StepLog(
            iteration=iteration,
            loss=float(table[:, 0].sum() / max(tokens_in_loss, 1.0)),
            lr=lr,
            grad_norm=float(result.grad_norm or 0.0),
            step_s=step_s,
            tokens=batches.global_tokens,
            stage_fwd_s=_stage_times(table, 2),
            stage_bwd_s=_stage_times(table, 3),
        )
        log.step(entry)
        if on_step is not None:
            on_step(iteration, state, result)
        if state["valid"] is not None and iteration % args.eval_interval == 0:
            r = evaluate(args, model, state["valid"], args.eval_iters)
            row = _gather_rows([r.loss_sum, r.loss_tokens])
            log.eval(iteration, float(row[:, 0].sum() / max(row[:, 1].sum(), 1.0)))
        if args.save and args.save_interval and iteration % args.save_interval == 0 \
                and iteration < args.train_iters:
            ckpt.save_checkpoint(args.save, iteration, model, optimizer, scheduler, loader, state["cpu"])
            log.info(f"saved checkpoint at iteration {iteration} to {args.save}")
        if args.exit_signal_handler and flag.any_rank():
            preempted = iteration < args.train_iters
            break
    if args.save and iteration > start:  # nothing new to save if no step ran
        ckpt.save_checkpoint(args.save, iteration, model, optimizer, scheduler, loader, state["cpu"])
        log.info(f"saved checkpoint at iteration {iteration} to {args.save}")
    summary = log.summary(preempted)
    return summary


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
            self.info(f"iter {s.iteration:6d}/{self.args.train_iters} | loss {s.loss:.4f} | lr {s.lr:.3e} | "
                      f"grad-norm {s.grad_norm:.3f} | step {s.step_s * 1e3:.0f} ms | "
                      f"tokens/s {tps:.0f} | fwd ms/stage [{fwd}] | bwd ms/stage [{bwd}]")
        if self.tb is not None:
            for name, value in (("loss", s.loss), ("lr", s.lr), ("grad-norm", s.grad_norm),
                                ("step-time-s", s.step_s), ("tokens-per-s", tps)):
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
            if preempted:
                rows.append(("stopped by", "signal (checkpoint saved)"))
            width = max(len(k) for k, _ in rows)
            lines = ["", "Training summary", "-" * (width + 24)]
            lines += [f"{k:<{width}}  {v}" for k, v in rows]
            print("\n".join(lines), flush=True)
            print("SUMMARY_JSON " + json.dumps(out), flush=True)
        return out
