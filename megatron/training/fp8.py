"""FP8 training through Transformer Engine: Megatron-LM's ``--fp8-format`` and its recipe flags.

As in Megatron-LM, the flags become megatron-core ``TransformerConfig`` fields (``fp8``,
``fp8_recipe``, ``fp8_margin``, ``fp8_interval``, ``fp8_amax_history_len``,
``fp8_amax_compute_algo``, ``fp8_wgrad``, ``first_last_layers_bf16`` and the bf16 layer counts;
``--fp8-param-gather`` is ``fp8_param`` and the DDP config's ``fp8_param_gather``) and
megatron-core does the rest: ``TransformerBlock`` builds the TE layers under TE's quantized
init when ``fp8_param`` is set and runs each layer's forward under TE's FP8 autocast with
the recipe (the layers kept in bf16 excepted). Only Transformer Engine's linears compute in
FP8; the core-attention slot (TE's dense attention, or this project's sparse one) stays in
bf16 (``fp8_dot_product_attention`` is off, Megatron-LM's default).

So FP8 needs the TE layer spec on a CUDA GPU (``--transformer-impl transformer_engine`` that
can build here: :func:`megatron.training.compat.check_hardware`); elsewhere the line is
refused in one line (the local spec has no FP8 GEMMs, and training it in bf16 instead would be
another run than the script's). Megatron-LM's rules: ``--fp8-param-gather`` needs the
distributed optimizer or FSDP (with ``--use-torch-fsdp2`` it is turned off with a warning,
as Megatron-LM does with TE >= 2.0), and ``fp8_param`` needs ``--fp8-format``; delayed scaling
keeps no first / last layers in bf16. ``--fp8-recipe custom`` (a quantizer factory), the
FP8 output projection and the MXFP8 buffer reuse are not wired and stay refused.
"""

from __future__ import annotations

import argparse

from megatron.training.arg_checks import UsageError

FLAGS = ("--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-interval", "--fp8-amax-history-len",
         "--fp8-amax-compute-algo", "--no-fp8-wgrad", "--disable-fp8-wgrad", "--fp8-param-gather",
         "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16")
"""The flags of this module (the launch check marks them as needing TE on a GPU)."""


def add_flags(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's FP8 flags (names, types, defaults of its ``TransformerConfig`` fields)."""
    g = p.add_argument_group("FP8 with Transformer Engine (Megatron-LM's flags; see fp8.py)")
    g.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default=None,
                   help="FP8 GEMMs in Transformer Engine's linears: e4m3, or hybrid (e4m3 forward, e5m2 "
                        "gradients); needs --transformer-impl transformer_engine on a CUDA GPU")
    g.add_argument("--fp8-recipe", choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
                   default="delayed", help="TE's scaling recipe (custom is not wired)")
    g.add_argument("--fp8-margin", type=int, default=0, help="scaling factor shift (2 ** margin)")
    g.add_argument("--fp8-interval", type=int, default=1, help="deprecated in TE >= 1.8 (ignored there)")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="amax history window (delayed scaling)")
    g.add_argument("--fp8-amax-compute-algo", choices=("most_recent", "max"), default="most_recent",
                   help="amax from the history (delayed scaling)")
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", dest="fp8_wgrad", action="store_false",
                   help="weight gradients in higher precision")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="TE parameters kept in FP8 and all-gathered in FP8 (needs the distributed optimizer)")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first / last transformer layers in bf16 (not with delayed scaling)")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1, help="with --first-last-layers-bf16")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1, help="with --first-last-layers-bf16")


def validate(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the flags (hardware: :func:`hardware_refusal`)."""
    if args.fp8_param_gather and args.fp8_format is None:
        raise UsageError("--fp8-param-gather needs --fp8-format (megatron-core raises the same)")
    if args.fp8_format is None:
        return
    if args.fp8_recipe == "custom":
        raise UsageError("--fp8-recipe custom needs --fp8-quantizer-factory, which this driver does not wire; "
                         "use tensorwise, delayed, mxfp8 or blockwise")
    if args.first_last_layers_bf16 and args.fp8_recipe == "delayed":
        raise UsageError("--first-last-layers-bf16 with --fp8-recipe delayed: delayed scaling keeps no layers in "
                         "bf16 (megatron-core raises the same)")
    if args.fp8_param_gather and getattr(args, "use_torch_fsdp2", False):
        args.fp8_param_gather = False  # Megatron-LM's validate_args with TE >= 2.0
        args.compat_warnings.append("--fp8-param-gather with --use-torch-fsdp2: turned off, parameters all-gathered "
                                    "in bf16 (as Megatron-LM does with Transformer Engine >= 2.0)")
    elif args.fp8_param_gather and not (args.use_distributed_optimizer or getattr(args, "use_megatron_fsdp", False)):
        raise UsageError("--fp8-param-gather needs --use-distributed-optimizer or FSDP (Megatron-LM asserts the same)")


def hardware_refusal(args: argparse.Namespace, te_why: str = "") -> str:
    """The one line for ``--fp8-format`` where Transformer Engine's layers do not build
    (``te_why``: why they do not; empty where the line asks for the local spec)."""
    why = te_why or "--transformer-impl local has no FP8 GEMMs"
    return (f"--fp8-format: needs Transformer Engine's layers on a CUDA GPU "
            f"(--transformer-impl transformer_engine); here {why}")


def config_fields(args: argparse.Namespace) -> dict:
    """``TransformerConfig`` fields (none without ``--fp8-format``: megatron-core's defaults)."""
    if getattr(args, "fp8_format", None) is None:
        return {}
    return {"fp8": args.fp8_format, "fp8_recipe": args.fp8_recipe, "fp8_param": args.fp8_param_gather,
            "fp8_margin": args.fp8_margin, "fp8_interval": args.fp8_interval,
            "fp8_amax_history_len": args.fp8_amax_history_len, "fp8_amax_compute_algo": args.fp8_amax_compute_algo,
            "fp8_wgrad": args.fp8_wgrad, "first_last_layers_bf16": args.first_last_layers_bf16,
            "num_layers_at_start_in_bf16": args.num_layers_at_start_in_bf16,
            "num_layers_at_end_in_bf16": args.num_layers_at_end_in_bf16}
