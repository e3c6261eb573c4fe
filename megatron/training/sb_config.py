"""The driver's one mapping from parsed flags to :class:`sparsebalance.config.SparseBalanceConfig`.

Called once per run (after ``arguments.parse_args`` resolved the ``--sparse-balance``
defaults); the library only ever sees the typed config, and after it is built the
driver reads the ``--sb-*`` settings from it, not from the flags (the exceptions: the
summary's echo of the flags as given, ``--sb-timeline``'s output directory, and the
checkpoint's settings fingerprint, which compare flags, not settings).
"""

from __future__ import annotations

from typing import Optional

from sparsebalance.config import (
    AttentionConfig,
    DSTConfig,
    ModelShape,
    PackingConfig,
    ParallelConfig,
    PredictorConfig,
    SparseBalanceConfig,
)


def attention_config(args) -> AttentionConfig:
    """``--sparse-attention`` and ``--sb-block-size|topk|attention-backend|dense-layers``."""
    threshold = args.sb_threshold if getattr(args, "sb_routing", "topk") == "threshold" else None
    return AttentionConfig(sparse=bool(args.sparse_attention), block_size=args.sb_block_size,
                           topk=args.sb_topk, backend=args.sb_attention_backend,
                           dense_layers=tuple(args.sb_dense_layers), threshold=threshold,
                           topk_min=(args.sb_topk_min or 0) if threshold is not None else 0,
                           per_head=getattr(args, "sb_threshold_counts", None) != "per-block")


def parallel_config(args) -> ParallelConfig:
    """Pipeline (virtual), context- and sequence-parallel sizes, and whether the run is on CPU."""
    from megatron.training.initialize import use_cpu

    sp = args.tensor_model_parallel_size if getattr(args, "sequence_parallel", False) else 1
    return ParallelConfig(pp=args.pipeline_model_parallel_size,
                          vpp=getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
                          cp=getattr(args, "context_parallel_size", 1) or 1, sp=sp, cpu=use_cpu(args),
                          group=getattr(args, "microbatch_group_size_per_vp_stage", None))


def model_config(args, vocab_size: int) -> ModelShape:
    """The model's shape (``vocab_size``: the padded vocabulary) with the attention's
    routing block size and static budget (None: dense)."""
    return ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads,
                      num_query_groups=args.num_query_groups or args.num_attention_heads,
                      kv_channels=getattr(args, "kv_channels", None),
                      ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
                      vocab_size=vocab_size, swiglu=bool(args.swiglu), block_size=args.sb_block_size,
                      topk=args.sb_topk if args.sparse_attention else None,
                      stage_layers=_stage_layers(args))


def _stage_layers(args) -> Optional[tuple]:
    """Each (virtual) pipeline stage's layers where a pipeline-split flag moves them
    (megatron-core's placement, so the cost model prices the stages the model builds: PP x VPP
    entries, virtual stage ``c * PP + r``, with the interleaved schedule); None: the even split."""
    from megatron.training import pipeline_layout
    from megatron.training.arg_checks import chunk_layers

    return tuple(chunk_layers(args)) if pipeline_layout.given(args) else None


def predictor_config(args) -> PredictorConfig:
    """``--sb-profile``, ``--sb-cost-model``, ``--sb-allow-stale-profile``, and the run's
    ``--seq-length``, ``--normalization`` and ``--bf16`` a profile must match."""
    return PredictorConfig(profile=args.sb_profile, cost_model=args.sb_cost_model,
                           allow_stale_profile=bool(args.sb_allow_stale_profile),
                           seq_length=args.seq_length, normalization=args.normalization,
                           bf16=bool(args.bf16))


def build_predictor(args, vocab_size: int, warn=None):
    """The latency predictor of ``--sb-profile`` / ``--sb-cost-model`` (None if neither),
    for ``pretrain_gpt.py``'s checks before any process group; raises as
    :func:`sparsebalance.balancer.build_predictor`. Builds only the parts of the config
    the predictor depends on (model shape, attention, predictor, parallel layout)."""
    from sparsebalance.balancer import build_predictor as build

    config = SparseBalanceConfig(model=model_config(args, vocab_size), attention=attention_config(args),
                                 predictor=predictor_config(args), parallel=parallel_config(args))
    return build(config, warn=warn)


def sparsebalance_config(args, vocab_size: int) -> SparseBalanceConfig:
    """The SparseBalance view of the run's flags (``vocab_size``: the padded vocabulary)."""
    packing = PackingConfig(strategy=args.sb_batching, max_carry_steps=args.max_carry_steps)
    dst = DSTConfig(policy=args.sb_dst, topk_min=args.sb_topk_min, topk_max=args.sb_topk_max,
                    anchor=args.sb_anchor, p=args.sb_p, attn_slack=args.sb_attn_slack,
                    floor=getattr(args, "sb_dst_floor", "stage"),
                    plan_ahead=bool(args.sb_plan_ahead), sensitivity=args.sb_dst_sensitivity,
                    sensitivity_study=args.sb_sensitivity_study,
                    stage_weight=getattr(args, "sb_stage_weight", None),
                    taus=getattr(args, "sb_dst_taus", None), tau_study=getattr(args, "sb_dst_tau_study", None))
    return SparseBalanceConfig(model=model_config(args, vocab_size), attention=attention_config(args),
                               packing=packing, dst=dst, predictor=predictor_config(args),
                               parallel=parallel_config(args))
