"""``--wandb-project``: the run's scalars to Weights & Biases, as Megatron-LM writes them.

What Megatron-LM does (``global_vars._set_wandb_writer``, ``training.training_log``,
``evaluate_and_print_results``), done the same here:

* only the last rank (``rank == world_size - 1``) writes, and only with ``--wandb-project``;
* ``wandb.init(project=--wandb-project, name=--wandb-exp-name, dir=--wandb-save-dir or
  SAVE/wandb, config=the parsed flags)``, ``entity=--wandb-entity`` when given; the
  directory is created first (wandb puts its ``run-*`` / ``offline-run-*`` folder in
  ``DIR/wandb``);
* each step's scalars are logged at ``step=iteration``, under Megatron-LM's names where it
  logs the same quantity (:data:`MEGATRON_LM_NAMES`: ``lm loss``, ``learning-rate``,
  ``iteration-time``, ``lm loss validation``, ...), this driver's other tensorboard
  scalars under their tensorboard names; ``finish()`` at the end of training.

One difference: Megatron-LM logs its training scalars to W&B only when ``--tensorboard-dir``
is given too (its W&B calls sit inside the tensorboard branch); here ``--wandb-project``
alone is enough.

The flags' usage errors are checked at parse (``arg_checks.validate_wandb``).
"""

from __future__ import annotations

import os
from typing import Iterable, Optional, Tuple

MEGATRON_LM_NAMES = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "step-time-s": "iteration-time",
    "validation-loss": "lm loss validation",
    "validation-ppl": "lm loss validation ppl",
}
"""Tensorboard name here -> the name Megatron-LM logs the same scalar under (W&B keys);
``grad-norm``, ``params-norm`` and ``num-zeros`` are spelt the same in both."""


def wandb_config(args) -> dict:
    """The flags as W&B's run config (Megatron-LM: ``vars(args)`` plus ``slurm_job_name``),
    without the placeholders of Megatron-LM flags this driver only accepts (``compat.py``)."""
    from megatron.training.compat import DEST_PREFIX

    config = {k: v for k, v in vars(args).items() if not k.startswith(DEST_PREFIX)}
    config["slurm_job_name"] = os.getenv("SLURM_JOB_NAME", "N/A")
    return config


def open_run(args, rank: int, world_size: int):
    """The W&B run this rank writes to: a ``wandb.Run`` on the last rank with
    ``--wandb-project``, else None (wandb is not imported)."""
    if not args.wandb_project or rank != world_size - 1:
        return None
    import wandb

    save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
    os.makedirs(save_dir, exist_ok=True)
    kwargs = {"dir": save_dir, "name": args.wandb_exp_name, "project": args.wandb_project,
              "config": wandb_config(args)}
    if args.wandb_entity:
        kwargs["entity"] = args.wandb_entity
    return wandb.init(**kwargs)


def log(run, scalars: Iterable[Tuple[str, Optional[float]]], iteration: int) -> None:
    """``run.log`` of ``(tensorboard name, value)`` pairs at ``step=iteration`` (None values
    left out), keyed by :data:`MEGATRON_LM_NAMES`."""
    row = {MEGATRON_LM_NAMES.get(name, name): value for name, value in scalars if value is not None}
    run.log(row, step=iteration)
