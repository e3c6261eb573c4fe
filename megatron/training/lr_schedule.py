"""Learning-rate / weight-decay schedule with Megatron-LM's flags and rules.

Megatron-LM counts its schedule in samples (each step adds the global batch size);
this driver steps the scheduler once per iteration, so every length here is in
iterations, with sample-based flags divided by ``--global-batch-size`` (a float: the
LR at each iteration is the one Megatron-LM's sample count gives).

Rules (Megatron-LM ``validate_args`` / ``get_optimizer_param_scheduler``):

* ``--train-iters`` and ``--train-samples`` exclude each other; with iterations the
  ``--lr-*-samples`` flags are not allowed, with samples the ``--lr-*-iters`` ones.
* decay length: ``--lr-decay-iters`` (or ``--lr-decay-samples``), else the training length.
* warmup: ``--lr-warmup-fraction`` x decay length, else ``--lr-warmup-iters`` / samples;
  the fraction and an explicit warmup length exclude each other.
* weight decay goes from ``--start-weight-decay`` to ``--end-weight-decay`` over the
  training length by ``--weight-decay-incr-style`` (both default to ``--weight-decay``).
* resume (:func:`resume_schedule`): without a flag the command line's schedule must
  equal the checkpoint's (Megatron-LM asserts); ``--override-opt_param-scheduler``
  takes the command line's, ``--use-checkpoint-opt_param-scheduler`` the checkpoint's.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, Optional

DEFAULT_TRAIN_ITERS = 20
"""``--train-iters`` when neither it nor ``--train-samples`` is given (Megatron-LM has none)."""

_CHECKED = (("max_lr", "--lr"), ("min_lr", "--min-lr"), ("lr_warmup_steps", "warmup length"),
            ("lr_decay_steps", "decay length"), ("lr_decay_style", "--lr-decay-style"),
            ("start_wd", "start weight decay"), ("end_wd", "end weight decay"),
            ("wd_incr_steps", "weight-decay length"), ("wd_incr_style", "--weight-decay-incr-style"))
"""Scheduler fields megatron-core compares on load, and how to name them to the user."""


def validate_schedule(args: argparse.Namespace, usage_error: Callable[[str], Exception]) -> None:
    """Apply Megatron-LM's rules; sets ``args.train_iters`` (and the derived lengths).

    Needs ``args.global_batch_size`` resolved. Raises ``usage_error(message)``.
    """
    gbs = args.global_batch_size
    if args.train_iters is not None and args.train_samples is not None:
        raise usage_error("give --train-iters or --train-samples, not both")
    by_samples = args.train_samples is not None
    # Each schedule length is counted in the unit of the training length: with --train-samples
    # the --lr-*-iters flags are refused (and the reverse), naming the flag to use instead.
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    for name in ("lr_decay", "lr_wsd_decay", "lr_warmup"):
        value = getattr(args, f"{name}_{other}")
        if value is not None and not (name == "lr_warmup" and value == 0):  # warm-up's default is 0
            flag = "--" + name.replace("_", "-")
            raise usage_error(f"{flag}-{other} goes with --train-{other}; with --train-{unit} use "
                              f"{flag}-{unit}")
    schedule = getattr(args, "batch_schedule", None)
    if by_samples and schedule:
        # Megatron-LM's update_train_iters under --step-batch-size-schedule: iterations until the
        # consumed samples reach --train-samples (the last one may pass it); the batch is the
        # first entry's while the run stays below the next threshold (checked after this)
        args.train_iters = -(-args.train_samples // gbs)
    elif by_samples:
        if args.train_samples < gbs:
            raise usage_error(f"--train-samples {args.train_samples} is less than one global batch "
                              f"({gbs} samples)")
        args.train_iters = args.train_samples // gbs
    elif args.train_iters is None:
        args.train_iters = DEFAULT_TRAIN_ITERS
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters or args.lr_warmup_samples:
            raise usage_error("give --lr-warmup-fraction or --lr-warmup-iters/--lr-warmup-samples, not both")
        if args.lr_warmup_fraction >= 1.0:
            raise usage_error(f"--lr-warmup-fraction must be < 1, got {args.lr_warmup_fraction}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise usage_error("give --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler, "
                          "not both")
    if args.lr_warmup_init > args.lr:
        raise usage_error(f"--lr-warmup-init {args.lr_warmup_init} is larger than --lr {args.lr}")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and args.lr_wsd_decay_samples is None:
        raise usage_error("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples)")
    start = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    if args.weight_decay_incr_style == "constant" and start != end:
        raise usage_error("--start-weight-decay and --end-weight-decay differ: give "
                          "--weight-decay-incr-style linear or cosine")
    if end < start:
        raise usage_error(f"--end-weight-decay {end} is smaller than --start-weight-decay {start}")
    steps = schedule_steps(args)
    unit = _iteration_samples(args)
    if unit != gbs:
        args.compat_warnings = [*getattr(args, "compat_warnings", []),
                                f"--step-batch-size-schedule with --train-iters: Megatron-LM counts the --lr-*-iters "
                                f"lengths and the weight-decay length in batches of micro-batch size x DP = {unit} "
                                f"samples while each iteration trains {gbs}: the LR decays over "
                                f"{steps['lr_decay_steps']:g} iterations (as in Megatron-LM; --train-samples with "
                                f"--lr-*-samples counts in the schedule's batches)"]
    if steps["lr_warmup_steps"] > args.train_iters:  # Megatron-LM runs it: the run ends in warmup
        args.compat_warnings = [*getattr(args, "compat_warnings", []),
                                f"the LR warmup ({steps['lr_warmup_steps']:g} iterations) is longer than the "
                                f"{args.train_iters} training iterations: the LR stays below --lr "
                                f"{args.lr:g} throughout (as in Megatron-LM)"]


def schedule_steps(args: argparse.Namespace) -> Dict[str, Optional[float]]:
    """Warmup, decay, WSD-decay and weight-decay lengths in iterations (see module docstring)."""
    gbs = args.global_batch_size
    by_samples = getattr(args, "train_samples", None) is not None
    if by_samples:
        decay = (args.lr_decay_samples or args.train_samples) / gbs
        warmup = args.lr_warmup_samples / gbs
        wsd = args.lr_wsd_decay_samples / gbs if args.lr_wsd_decay_samples else None
        wd = args.train_samples / gbs  # Megatron-LM: over --train-samples
    else:
        # Megatron-LM multiplies the --lr-*-iters lengths by its args.global_batch_size and steps
        # its scheduler by the samples of each iteration: in iterations here, x unit / gbs (1
        # unless a batch schedule makes its args.global_batch_size micro-batch size x DP)
        scale = _iteration_samples(args) / gbs
        decay = float(args.lr_decay_iters or args.train_iters) * scale
        warmup = float(args.lr_warmup_iters) * scale
        wsd = float(args.lr_wsd_decay_iters) * scale if args.lr_wsd_decay_iters else None
        wd = float(args.train_iters) * scale
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    # megatron-core needs decay > warmup; a run that is all warmup decays over one more step
    decay = max(decay, warmup + 1)
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wsd_decay_steps": wsd, "wd_incr_steps": wd}


def _iteration_samples(args: argparse.Namespace) -> int:
    """Samples Megatron-LM's scheduler counts per ``--lr-*-iters`` iteration: its
    ``args.global_batch_size``, which is micro-batch size x DP under ``--step-batch-size-schedule``
    (validate_args' default; the schedule excludes the flag) and the global batch otherwise."""
    if getattr(args, "batch_schedule", None) and getattr(args, "train_samples", None) is None:
        return args.micro_batch_size * args.data_parallel_size
    return args.global_batch_size


def scheduler_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of megatron-core's ``OptimizerParamScheduler`` (besides the optimizer)."""
    steps = schedule_steps(args)
    start = args.weight_decay if args.start_weight_decay is None else args.start_weight_decay
    end = args.weight_decay if args.end_weight_decay is None else args.end_weight_decay
    return dict(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=steps["lr_warmup_steps"], lr_decay_steps=steps["lr_decay_steps"],
        lr_decay_style=args.lr_decay_style, start_wd=start, end_wd=end,
        wd_incr_steps=steps["wd_incr_steps"], wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=steps["wsd_decay_steps"], lr_wsd_decay_style=args.lr_wsd_decay_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def resume_schedule(scheduler, saved: dict) -> Optional[str]:
    """Before ``scheduler`` (megatron-core ``OptimizerParamScheduler``, built with this command
    line's flags) loads ``saved`` (its ``state_dict``): apply Megatron-LM's rule. Returns the
    line that says which schedule the resumed run uses when the two differ (None when equal).

    Raises ``ValueError`` (one line naming the first field that differs and both flags)
    when the schedules differ and neither flag was given (Megatron-LM asserts there).
    """
    differ = [(name, label, getattr(scheduler, name), saved[name]) for name, label in _CHECKED
              if name in saved and getattr(scheduler, name) != saved[name]]
    resumed = saved.get("num_steps", 0)
    if not differ:
        return None
    what = "; ".join(f"{label} {new!r} vs checkpoint {old!r}" for _, label, new, old in differ)
    if scheduler.override_opt_param_scheduler:
        return f"LR schedule: this command line's (--override-opt_param-scheduler; {what}), from step {resumed:g}"
    if scheduler.use_checkpoint_opt_param_scheduler:
        return (f"LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler; ignoring {what}), "
                f"from step {resumed:g}")
    raise ValueError(f"--load: the LR schedule differs from the checkpoint's ({what}); pass "
                     "--override-opt_param-scheduler to use this command line's or "
                     "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
