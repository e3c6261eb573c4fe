"""Megatron-LM flag families honoured here with Megatron-LM's meaning, each with its own rules.

* Expert tensor parallelism (``--expert-tensor-parallel-size``): the size of megatron-core's
  expert tensor-parallel groups (``initialize_model_parallel``'s argument; default: TP, as in
  Megatron-LM). This driver trains dense models (``--num-experts`` stays refused), so the
  groups are formed and no layer uses them: in Megatron-LM too a dense model ignores them.
* FSDP (``--use-megatron-fsdp``, ``--use-torch-fsdp2``): the same mathematics as
  data-parallel training (every rank's gradients averaged, one optimizer step on the full
  parameters). Here it trains as megatron-core's DDP (Megatron FSDP v1 with megatron-core's
  ``DistributedOptimizer``, as Megatron-LM pairs them; FSDP2 with plain DDP), with one
  warning line: parameters and gradients are not sharded (memory only), and Megatron
  FSDP's ``--ckpt-format fsdp_dtensor`` is written as ``torch_dist``. Megatron-LM's rules
  for these flags (``validate_args``) are kept; a dtype that would change the numerics is
  refused.
"""

from __future__ import annotations

import argparse

from megatron.training.arg_checks import UsageError

FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")
"""Megatron-LM's choices for ``--megatron-fsdp-*-dtype``."""


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the families above (Megatron-LM's names, types and defaults)."""
    g = p.add_argument_group("expert parallel groups and FSDP (Megatron-LM's flags; see families.py)")
    g.add_argument("--expert-tensor-parallel-size", type=_positive_int, default=None, metavar="N",
                   help="size of megatron-core's expert tensor-parallel groups (default: TP); no layer "
                        "uses them in the dense models trained here, as in Megatron-LM")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="trains as DDP with the distributed optimizer (same math; parameters and "
                        "gradients not sharded: one warning)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="trains as DDP (same math; nothing sharded: one warning)")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
                   help="with --use-megatron-fsdp: what Megatron FSDP shards (memory only here: the "
                        "optimizer state is sharded, parameters and gradients are not)")
    g.add_argument("--megatron-fsdp-main-params-dtype", default="fp32", choices=FSDP_DTYPES,
                   help="with --use-megatron-fsdp: only fp32 (the distributed optimizer's fp32 main params)")
    g.add_argument("--megatron-fsdp-main-grads-dtype", default="auto", choices=FSDP_DTYPES,
                   help="with --use-megatron-fsdp: only fp32 (gradients are kept and reduced in fp32 here)")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", default="auto", choices=FSDP_DTYPES,
                   help="with --use-megatron-fsdp: only fp32 (gradients are reduced in fp32 here)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's rules for these families and what each resolves to here."""
    _validate_expert_groups(args, world_size)
    _validate_fsdp(args)


def _validate_expert_groups(args: argparse.Namespace, world_size: int) -> None:
    if args.expert_tensor_parallel_size is None:  # Megatron-LM's validate_args
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    groups = args.expert_tensor_parallel_size * args.pipeline_model_parallel_size
    if world_size % groups:  # megatron-core's initialize_model_parallel raises the same
        raise UsageError(f"world size {world_size} is not divisible by --expert-tensor-parallel-size x PP = "
                         f"{args.expert_tensor_parallel_size} x {args.pipeline_model_parallel_size}")


def _validate_fsdp(args: argparse.Namespace) -> None:
    if args.use_megatron_fsdp and args.use_torch_fsdp2:
        raise UsageError("give --use-megatron-fsdp or --use-torch-fsdp2, not both")
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        raise UsageError("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM asserts the same)")
    if args.use_torch_fsdp2:
        _torch_fsdp2(args)
    elif args.use_megatron_fsdp:
        _megatron_fsdp(args)


def _torch_fsdp2(args: argparse.Namespace) -> None:
    """Megatron-LM's asserts for ``--use-torch-fsdp2`` (validate_args), then plain DDP."""
    for bad, why in ((args.pipeline_model_parallel_size > 1, "is not supported with pipeline parallelism"),
                     (args.use_distributed_optimizer, "is not supported with MCore's distributed optimizer"),
                     (args.ckpt_format not in ("torch_dist", "torch_dcp"), "requires --ckpt-format torch_dist"),
                     (not args.untie_embeddings_and_output_weights,
                      "requires --untie-embeddings-and-output-weights"),
                     (args.fp16, "is not supported with --fp16")):
        if bad:
            raise UsageError(f"--use-torch-fsdp2 {why} (Megatron-LM asserts the same)")
    args.compat_warnings.append("--use-torch-fsdp2: trained as DDP, the same math (gradients averaged over "
                                "data-parallel ranks, one Adam step on the full parameters); parameters, gradients "
                                "and optimizer state are replicated, not sharded (memory only)")


def _megatron_fsdp(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for ``--use-megatron-fsdp`` (v1: the distributed optimizer), then DDP."""
    if args.ckpt_format != "fsdp_dtensor":
        raise UsageError("--use-megatron-fsdp requires --ckpt-format fsdp_dtensor (Megatron-LM asserts the same)")
    for flag, value in (("--megatron-fsdp-main-params-dtype", args.megatron_fsdp_main_params_dtype),
                        ("--megatron-fsdp-main-grads-dtype", args.megatron_fsdp_main_grads_dtype),
                        ("--megatron-fsdp-grad-comm-dtype", args.megatron_fsdp_grad_comm_dtype)):
        if value != "fp32":
            raise UsageError(f"{flag} {value}: with --use-megatron-fsdp only fp32 is implemented (this driver "
                             "keeps fp32 main parameters and reduces gradients in fp32); give fp32")
    args.use_distributed_optimizer = True  # Megatron FSDP v1 uses it (Megatron-LM sets it, with a warning)
    args.ckpt_format = "torch_dist"
    args.compat_warnings.append(f"--use-megatron-fsdp: trained as DDP with the distributed optimizer, the same math; "
                                f"the optimizer state is sharded, parameters and gradients are not "
                                f"(--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}: memory "
                                "only), and checkpoints are written as torch_dist, not fsdp_dtensor")
