"""Model, optimizer and LR schedule from megatron-core pieces.

* :func:`transformer_config` — ``TransformerConfig`` from the parsed args. Packed
  THD micro-batches have a different token count each, so
  ``variable_seq_lengths=True`` (p2p exchanges shapes first) and nothing is
  padded; the loss is per token (``calculate_per_token_loss``): the step's loss
  is sum over all real tokens of the global batch / their number, whatever the
  DP x PP layout.
* :func:`build_model` — one ``GPTModel`` per virtual pipeline chunk, wrapped in
  megatron-core's ``DistributedDataParallel``.
* :func:`build_optimizer` — ``get_megatron_optimizer`` (Adam) and
  ``OptimizerParamScheduler``. ``--use-distributed-optimizer`` selects megatron's
  ``DistributedOptimizer`` (Adam state sharded over DP ranks; gradients
  reduce-scattered, updated weights all-gathered by the DDP buffers), with
  ``--overlap-grad-reduce`` / ``--overlap-param-gather`` as Megatron-LM's flags; on
  CPU it runs through ``cpu_bridge.py``.

With ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear`` the chunks are
``loss_chunks.ChunkedLossGPTModel``: the output layer and the loss run in chunks of tokens.

Activation recomputation (``--recompute-granularity``) is megatron-core's own
(``TransformerBlock._checkpointed_forward`` for full, ``Attention``'s
checkpointed core attention for selective). Its ``CheckpointFunction`` saves the
RNG states before the checkpointed forward and restores them around the
recomputation; on CPU :func:`install_cpu_recompute_rng` makes that work.
"""

from __future__ import annotations

import re
import warnings
from typing import Dict, List

import torch

from megatron.training import fp8, mup, pipeline_layout, yarn


def layer_spec(args, attention=None):
    """Layer spec for GPTModel: dense varlen attention, or the sparse one with --sparse-attention.

    Args:
        attention: the run's :class:`~sparsebalance.config.AttentionConfig` (None: built
            from ``args``, for tools that build a model without a training run).
    """
    if attention is None:
        from megatron.training.sb_config import attention_config

        attention = attention_config(args)
    # validation puts --transformer-impl back to local where CUDA or TE is missing
    # (compat.check_hardware); tools that build a model from their own parser (convert.py,
    # profile_latency.py) meet the same rule here
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine" and _te_runs(args)
    if attention.sparse:
        # Imported lazily: the sparse module is optional until --sparse-attention is used.
        from sparsebalance.attention.sparse import get_gpt_layer_sparse_spec

        return get_gpt_layer_sparse_spec(
            block_size=attention.block_size,
            topk=attention.topk,
            backend=attention.backend,
            dense_layers=attention.dense_layers,
            normalization=args.normalization,
            # threshold routing: the budget (--sb-topk, or DST's per micro-batch) is the cap
            threshold=attention.threshold,
            topk_min=attention.topk_min,
            per_head=attention.per_head,
            qk_layernorm=args.qk_layernorm,
            use_te=use_te,
        )
    mla = bool(getattr(args, "multi_latent_attention", False))
    if use_te:  # Megatron-LM's dense path: TE's core attention, --attention-backend picks its kernel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=mla)
    from sparsebalance.attention.spec import get_gpt_layer_dense_spec

    return get_gpt_layer_dense_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm, use_te=False,
                                    multi_latent_attention=mla)


def _te_runs(args) -> bool:
    """Whether Transformer Engine's layers can build here: CUDA in use and the package present."""
    from megatron.training.arg_checks import has_cuda, has_transformer_engine

    return not getattr(args, "cpu", False) and has_cuda() and has_transformer_engine()


def transformer_config(args, use_cpu: bool):
    """megatron-core ``TransformerConfig`` for the parsed args."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if getattr(args, "fp16", False) else torch.float32
    interleaved = args.virtual_pipeline_model_parallel_size is not None
    with warnings.catch_warnings():
        # Selective recompute warns that TE's fused core attention needs no recompute;
        # our core_attention slot never holds TE's module (see layer_spec).
        warnings.filterwarnings("ignore", message=r".*no need to set 'core_attn' to recompute.*")
        config = _transformer_config(args, use_cpu, dtype, interleaved)
    # YaRN's settings are attributes megatron-core reads off the config, not dataclass fields
    yarn.apply_to_config(config, args)
    return config


def _transformer_config(args, use_cpu: bool, dtype: torch.dtype, interleaved: bool):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    config_class, mla = TransformerConfig, {}
    if getattr(args, "multi_latent_attention", False):  # megatron-core's MLA (families.py)
        from megatron.training.families import mla_config_fields

        config_class, mla = MLATransformerConfig, mla_config_fields(args)
    return config_class(
        **mla,
        **mup.config_fields(args),  # Megatron-LM main's muP: init scales, softmax scale (mup.py)
        **fp8.config_fields(args),  # FP8 in Transformer Engine's linears (fp8.py)
        kv_channels=getattr(args, "kv_channels", None),
        fp16=getattr(args, "fp16", False),
        attention_backend=AttnBackend[getattr(args, "attention_backend", "auto")],
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        init_method_std=args.init_method_std,
        gated_linear_unit=args.swiglu,
        activation_func=_activation(args),
        # Megatron-LM's --apply-layernorm-1p: norms scale by 1 + weight (spec.TorchNorm on CPU)
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        qk_layernorm=args.qk_layernorm,
        test_mode=args.test_mode,
        attention_output_gate=args.attention_output_gate,
        rotary_interleaved=args.rotary_interleaved,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        # Megatron's sequence parallelism: norms and residuals on 1/TP of the tokens (data.py
        # pads each micro-batch for it); the core attention sees the gathered sequence.
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        # Megatron-LM's pipeline-split flags (checked in pipeline_layout.py)
        **pipeline_layout.config_fields(args),
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_vp_stage", None),
        # Context parallelism: our core_attention modules all-gather K/V over the CP group
        # (sparsebalance.attention.context_parallel); the split is done by data.py.
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        cp_comm_type="all_gather" if getattr(args, "context_parallel_size", 1) > 1 else None,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        # megatron-core applies the hidden dropout (embeddings, after attention and MLP); the
        # dense core-attention modules read attention_dropout; the sparse kernels apply none
        # (parse_args refuses a value the line sets with sparse attention; tools that build a
        # model from their own parser get 0 here)
        hidden_dropout=args.hidden_dropout,
        attention_dropout=0.0 if (getattr(args, "sparse_attention", False) or getattr(args, "sparse_balance", False))
        else args.attention_dropout,
        use_cpu_initialization=use_cpu,
        # Packed micro-batches differ in length; the interleaved schedule gets padded
        # ones instead (see data.py for why).
        variable_seq_lengths=not interleaved,
        # Interleaving with PP=2 sends and receives to the same peer in one call;
        # batched p2p posts them in an order gloo matches wrongly, the unbatched
        # path orders them by rank parity.
        batch_p2p_comm=not interleaved,
        # megatron rejects variable_seq_lengths with the default MoE dispatcher even
        # without experts; alltoall is the one it accepts (unused: we have no MoE).
        moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=True,
        # Fused kernels are CUDA-only; on CPU use the unfused paths. megatron-core fuses
        # only GeLU and SwiGLU with the bias.
        bias_activation_fusion=not use_cpu and not args.squared_relu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # unfused RoPE: it multiplies cos/sin by YaRN's attention factor, which TE's fused one refuses
        apply_rope_fusion=False,
        # Activation recomputation (Megatron-LM's flags; checked in arguments.py). Selective
        # recomputes the module in the core_attention slot, i.e. ours (dense or sparse).
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_method=getattr(args, "recompute_method", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None),
        recompute_modules=["core_attn"],
    )


def _activation(args):
    """The MLP's activation: SiLU (gated) with --swiglu, squared ReLU with --squared-relu
    (Megatron-LM's; the two exclude each other), else GeLU."""
    if args.squared_relu:
        from megatron.core.activations import squared_relu

        return squared_relu
    return torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu


_CPU_RECOMPUTE_RNG: List[str] = []


def install_cpu_recompute_rng() -> bool:
    """Let megatron-core's activation checkpointing run without CUDA; idempotent.

    ``tensor_parallel.random.CheckpointFunction`` stores (CPU RNG state, CUDA default
    generator state, RNG-tracker states) with ``_get_all_rng_states`` and puts them
    back for the recomputed forward with ``_set_all_rng_states``. Only the CUDA
    generator part needs CUDA (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
    initialise it and fail without a GPU). On CPU there is no CUDA generator to
    preserve, so as ``tensor_parallel.random`` sees them those two become no-ops
    (the state is ``None``); megatron still saves and restores the CPU RNG state and
    the tracker's states (empty on CPU: the driver never seeds CUDA trackers and
    runs without dropout). ``cpu_bridge.py`` bridges device placement; this is the
    only RNG spot recomputation adds, so it stays next to the model that needs it.
    Returns True when it patched (now or before).
    """
    if _CPU_RECOMPUTE_RNG:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    _CPU_RECOMPUTE_RNG.append(mrandom.__name__)
    return True


def build_gpt_chunks(args, config, vocab_size: int, attention=None) -> List[torch.nn.Module]:
    """``GPTModel`` chunks of this pipeline rank (one per virtual stage), unwrapped
    (``attention``: as :func:`layer_spec`)."""
    from megatron.core.models.gpt import GPTModel

    from megatron.training.initialize import use_cpu

    if config.recompute_granularity is not None and use_cpu(args):
        install_cpu_recompute_rng()
    if attention is None:
        from megatron.training.sb_config import attention_config

        attention = attention_config(args)
    if getattr(args, "multi_latent_attention", False):
        from megatron.training.families import mla_without_te

        mla_without_te()
    spec = layer_spec(args, attention)
    if attention.sparse:  # one compiled gate for every micro-batch up to --seq-length
        from sparsebalance.ops.plan import set_route_width

        set_route_width(-(-args.seq_length // attention.block_size))
    model_class, extra = GPTModel, {}
    if getattr(args, "loss_chunk_tokens", 0):  # --cross-entropy-fusion-impl linear: the loss in chunks
        from megatron.training.loss_chunks import ChunkedLossGPTModel

        model_class, extra = ChunkedLossGPTModel, {"loss_chunk_tokens": args.loss_chunk_tokens}
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    with _tied_embedding_sync(args):
        for vp_stage in range(vpp or 1):
            chunks.append(_gpt_chunk(args, config, spec, vocab_size, model_class, extra, vp_stage if vpp else None))
    return chunks


def _tied_embedding_sync(args):
    """On CPU, megatron-core's first sync of tied embeddings over pipeline stages
    (:func:`~megatron.training.cpu_bridge.tied_embedding_sync_on_cpu`); else nothing."""
    import contextlib

    from megatron.training.initialize import use_cpu

    if use_cpu(args) and args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        from megatron.training.cpu_bridge import tied_embedding_sync_on_cpu

        return tied_embedding_sync_on_cpu()
    return contextlib.nullcontext()


def _gpt_chunk(args, config, spec, vocab_size, model_class, extra, stage):
    """One pipeline chunk (virtual stage ``stage``), on its device."""
    from megatron.core import parallel_state as ps

    from megatron.training.initialize import use_cpu
    from sparsebalance.attention.spec import get_gpt_decoder_spec

    chunk = model_class(
        config=config,
        transformer_layer_spec=get_gpt_decoder_spec(spec, config, stage),
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        seq_len_interpolation_factor=getattr(args, "rotary_seq_len_interpolation_factor", None),
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=stage,
        **extra,
    )
    mup.apply_to_chunk(args, chunk)
    if use_cpu(args):
        return chunk.cpu()
    return chunk.cuda(torch.cuda.current_device())


def build_model(args, config, vocab_size: int, attention=None) -> List[torch.nn.Module]:
    """``GPTModel`` chunks of this pipeline rank (one per virtual stage), DDP-wrapped
    (``attention``: as :func:`layer_spec`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    chunks = build_gpt_chunks(args, config, vocab_size, attention)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
        use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        fp8_param_gather=bool(getattr(args, "fp8_param_gather", False)),  # fp8.py
    )
    return [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # Bucketing only matters for overlapping comm on GPU; one buffer per chunk suffices.
            disable_bucketing=(i > 0),
        )
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(args, model: List[torch.nn.Module]):
    """megatron-core Adam (``get_megatron_optimizer``) and ``OptimizerParamScheduler``."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron.training.lr_schedule import scheduler_kwargs

    fp16 = getattr(args, "fp16", False)
    opt_config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        bf16=args.bf16,
        fp16=fp16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float16 if fp16 else torch.float32,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        clip_grad=args.clip_grad,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        use_distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        log_num_zeros_in_grad=bool(getattr(args, "log_num_zeros_in_grad", False)),
        # Megatron-LM's --decoupled-lr / --decoupled-min-lr: the peak / minimum LR of the
        # parameter groups of the input embedding and output layer (megatron-core marks them
        # is_embedding_or_output_parameter); the scheduler runs each group on its own pair.
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        # weight decay on the q/k layernorm weights (other 1-D parameters and biases get none)
        apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
    )
    if opt_config.use_distributed_optimizer:
        # Harmless and once per rank: megatron zeroes the .grad of its fp32 main-param
        # shards (views of the weights, so non-leaf tensors) and its grad buffers call
        # torch's deprecated collective names.
        warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor that is not a leaf")
        warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(reduce_scatter_tensor|"
                                                  r"all_gather_into_tensor)` is deprecated")
    # --use-mup: Megatron-LM main's per-group LR and Adam eps (mup.py); else megatron-core's standard groups
    optimizer = get_megatron_optimizer(opt_config, model, config_overrides=mup.optimizer_overrides(args, opt_config))
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_kwargs(args))
    return optimizer, scheduler


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def global_param_names(chunk: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """``{name: param}`` with layer indices made global (``layer_number - 1``), so
    names agree between PP layouts; used to compare runs."""
    inner = chunk.module if hasattr(chunk, "module") else chunk
    layers = inner.decoder.layers if hasattr(inner, "decoder") else []
    offset = {str(i): layer.layer_number - 1 for i, layer in enumerate(layers)}
    out = {}
    for name, param in inner.named_parameters():
        out[_LAYER.sub(lambda m: f"{m.group(1)}layers.{offset[m.group(2)]}.", name, count=1)] = param
    return out
