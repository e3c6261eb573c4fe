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
* Multi-latent attention (``--multi-latent-attention`` and its ranks and head sizes):
  megatron-core's ``MLASelfAttention`` (its layer spec, its ``MLATransformerConfig`` with
  Megatron-LM's defaults: ``--rope-type`` yarn unless given, ``--rotary-scaling-factor``,
  ``--mscale``, ``--mscale-all-dim``, ``--rotary-base``), with this project's dense attention
  in its core-attention slot (query/key heads of ``qk-head-dim + qk-pos-emb-head-dim``,
  value heads of ``v-head-dim``); on a GPU with ``--transformer-impl transformer_engine``,
  megatron-core's TE spec for MLA. Sparse attention with MLA is refused (one line).
* muP (``--use-mup``, ``--mup-*``): Megatron-LM main's Maximal Update Parameterization,
  which megatron-core 0.16.1 lacks, built from the driver's side (``mup.py``).
* FP8 (``--fp8-format`` and its recipe flags): megatron-core's TransformerConfig fields, in
  Transformer Engine's layers on a CUDA GPU; refused in one line elsewhere (``fp8.py``).
"""

from __future__ import annotations

import argparse

from megatron.training import fp8, mup
from megatron.training.arg_checks import UsageError

FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")
"""Megatron-LM's choices for ``--megatron-fsdp-*-dtype``."""


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the families above (Megatron-LM's names, types and defaults)."""
    from megatron.training.arguments import _positive  # at call time: arguments imports this module

    _positive_int = _positive(int)
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


    m = p.add_argument_group("multi-latent attention (Megatron-LM's flags and defaults; see families.py)")
    m.add_argument("--multi-latent-attention", action="store_true",
                   help="megatron-core's multi-latent attention (MLASelfAttention) in every layer")
    m.add_argument("--q-lora-rank", type=_positive_int, default=None,
                   help="rank of the query's low-rank projection (default: none, a full query projection)")
    m.add_argument("--kv-lora-rank", type=_positive_int, default=32, help="rank of the keys' and values' latent")
    m.add_argument("--qk-head-dim", type=_positive_int, default=128,
                   help="query/key head dims without position (q head = this + --qk-pos-emb-head-dim)")
    m.add_argument("--qk-pos-emb-head-dim", type=_positive_int, default=64, help="query/key head dims RoPE rotates")
    m.add_argument("--v-head-dim", type=_positive_int, default=128, help="value head dims")
    m.add_argument("--rope-type", choices=("rope", "yarn"), default=None,
                   help="MLA's RoPE (default yarn, as in Megatron-LM); without MLA only rope (the GPT "
                        "layers' YaRN is --position-embedding-type yarn)")
    mup.add_flags(p)
    fp8.add_flags(p)


def mla_config_fields(args: argparse.Namespace) -> dict:
    """``MLATransformerConfig``'s fields from the flags (Megatron-LM's ``core_transformer_config_from_args``:
    the fields named like a flag; ``rope_type`` left to the class's default, yarn, when not given)."""
    fields = {name: getattr(args, name) for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                                       "qk_pos_emb_head_dim", "v_head_dim", "rotary_base",
                                                       "rotary_percent", "rotary_scaling_factor", "mscale",
                                                       "mscale_all_dim")}
    if args.rope_type is not None:
        fields["rope_type"] = args.rope_type
    return fields


def mla_without_te() -> None:
    """megatron-core 0.16.1's ``multi_latent_attention`` imports its Transformer Engine classes
    from ``megatron.core.extensions.transformer_engine``, which without TE defines them over a
    ``MagicMock`` instead of failing; so the module sets its ``HAVE_TE`` and then calls
    ``isinstance(linear_proj, TELinear)`` with a mock (TypeError). Where the
    ``transformer_engine`` package is absent its ``HAVE_TE`` is set to what is true."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's rules for these families and what each resolves to here."""
    _validate_expert_groups(args, world_size)
    _validate_fsdp(args)
    _validate_mla(args)
    mup.validate(args)
    fp8.validate(args)


def _validate_mla(args: argparse.Namespace) -> None:
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":
            raise UsageError("--rope-type yarn picks multi-latent attention's RoPE (Megatron-LM asserts rope "
                             "without it); YaRN on the GPT layers is --position-embedding-type yarn")
        return
    if args.group_query_attention:  # Megatron-LM's validate_args
        raise UsageError("--group-query-attention and --multi-latent-attention exclude each other "
                         "(Megatron-LM asserts the same)")
    if args.context_parallel_size > 1:
        raise UsageError("--multi-latent-attention with --context-parallel-size > 1 is not supported (this driver's "
                         "context-parallel attention takes query, key and value heads of one size)")
    if args.sparse_attention or args.sparse_balance:
        raise UsageError("--multi-latent-attention with sparse attention is not supported (the sparse kernels "
                         "take query, key and value heads of one size)")


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
