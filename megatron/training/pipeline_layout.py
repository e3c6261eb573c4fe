"""Megatron-LM's pipeline-split flags: which transformer layers each pipeline stage holds.

``--decoder-first/last-pipeline-num-layers`` (uneven first / last stage),
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
(the embedding / the loss count as one layer of the split) and
``--pipeline-model-parallel-layout`` (a layout string such as ``"Ettt|(tt|)*2,tL"``:
``E`` embedding, ``t`` transformer layer, ``L`` loss, ``|`` between stages).

Megatron-LM's rules are ``validate_args`` (which flags go together, divisibility) and
megatron-core's ``TransformerConfig`` (the rest); megatron-core places the layers
(``get_num_layers_to_build``, ``PipelineParallelLayerLayout``). This module asks megatron-core
for the counts, so the cost model and the model builder cannot disagree, and refuses in one
line what this driver does not build: the uneven first / last stage and a layout with the
interleaved schedule, a layout whose embedding is not on the first stage or whose loss is
not on the last one, and multi-token prediction (``m``). The counted embedding / loss do
go with the interleaved schedule, as in Megatron-LM: they are a layer of the first / last
model chunk's share, so those chunks build one layer fewer (:func:`chunk_layers`).
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional

FLAGS = {"decoder_first_pipeline_num_layers": "--decoder-first-pipeline-num-layers",
         "decoder_last_pipeline_num_layers": "--decoder-last-pipeline-num-layers",
         "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
         "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
         "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout"}
"""``args`` field -> flag, for every flag that moves layers between pipeline stages."""


def given(args: argparse.Namespace) -> List[str]:
    """The pipeline-split flags the command line sets (in :data:`FLAGS` order)."""
    return [flag for dest, flag in FLAGS.items() if getattr(args, dest, None) not in (None, False)]


def config_fields(args: argparse.Namespace) -> Dict[str, object]:
    """The ``TransformerConfig`` fields these flags set (megatron-core builds the stages)."""
    return {"num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
            "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
            "account_for_embedding_in_pipeline_split": bool(args.account_for_embedding_in_pipeline_split),
            "account_for_loss_in_pipeline_split": bool(args.account_for_loss_in_pipeline_split),
            "pipeline_model_parallel_layout": args.pipeline_model_parallel_layout}


def split_units(args: argparse.Namespace) -> int:
    """``--num-layers`` plus the embedding / loss where the split counts them (Megatron-LM's
    ``validate_args``: the units spread over the pipeline and its virtual stages)."""
    return args.num_layers + int(bool(args.account_for_embedding_in_pipeline_split)) \
        + int(bool(args.account_for_loss_in_pipeline_split))


def virtual_stages(args: argparse.Namespace) -> Optional[int]:
    """Model chunks per pipeline rank as Megatron-LM's ``validate_args`` sets
    ``virtual_pipeline_model_parallel_size``: ``--num-virtual-stages-per-pipeline-rank``, or a
    stage's units (:func:`split_units` / PP) over ``--num-layers-per-virtual-pipeline-stage``;
    None for one chunk per rank (a result of 1 included: plain 1F1B there)."""
    vstages, vpl = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    if args.pipeline_model_parallel_size < 2:  # refused with either flag (arguments.validate)
        return None
    if vstages is not None:
        vpp = vstages
    elif vpl is not None:
        vpp = split_units(args) // args.pipeline_model_parallel_size // vpl
    else:
        return None
    return vpp if vpp > 1 else None


def _config(args: argparse.Namespace):
    """A ``TransformerConfig`` holding only the split (a one-head width keeps megatron-core's
    other checks quiet); ValueError (one line, megatron-core's reason) for a split it rejects."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        return TransformerConfig(num_layers=args.num_layers, hidden_size=8, num_attention_heads=1,
                                 pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                 virtual_pipeline_model_parallel_size=virtual_stages(args),
                                 pipeline_dtype=torch.float32, **config_fields(args))
    except (AssertionError, ValueError) as e:
        raise ValueError(" ".join(str(e).split())) from None


def chunk_layers(args: argparse.Namespace) -> List[int]:
    """Transformer layers of each model chunk in model order (virtual stage ``c * PP + r`` is
    chunk ``c`` of pipeline rank ``r``; PP entries without the interleaved schedule), as
    megatron-core builds them for these flags; ValueError (one line) for a split it rejects."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp, vpp = args.pipeline_model_parallel_size, virtual_stages(args)
    config = _config(args)
    try:
        layout = config.pipeline_model_parallel_layout
        if layout is not None:  # its counts need no process group when the rank is given
            return [layout.get_num_layers_to_build(pp_rank=r, vp_stage=0) for r in range(pp)]
        return [get_num_layers_to_build(config, vp_stage=c if vpp else None, pp_rank=r)
                for c in range(vpp or 1) for r in range(pp)]
    except (AssertionError, ValueError) as e:
        raise ValueError(" ".join(str(e).split())) from None


def stage_layers(args: argparse.Namespace) -> List[int]:
    """Transformer layers of each pipeline stage (all its model chunks), as megatron-core
    places them for these flags; ValueError (one line, megatron-core's reason) for a split it
    rejects."""
    chunks, pp = chunk_layers(args), args.pipeline_model_parallel_size
    return [sum(chunks[r::pp]) for r in range(pp)]


def _check_layout_string(text: str, pp: int, num_layers: int) -> None:
    """The placements megatron-core accepts and this driver builds (ValueError, one line)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(text)
    except AssertionError as e:
        raise ValueError(" ".join(str(e).split())) from None
    if len(stages) != pp:
        # Megatron-LM reads pp x vpp stages from the string; this driver keeps interleaved chunks equal
        raise ValueError(f"{len(stages)} stages for --pipeline-model-parallel-size {pp} (a layout of "
                         f"PP x VPP stages asks for the interleaved schedule, not supported with a layout here)")
    names = [[layer.name for layer in stage] for stage in stages]
    decoders = sum(stage.count("decoder") for stage in names)
    if decoders != num_layers:
        raise ValueError(f"the layout holds {decoders} transformer layers (t), --num-layers is {num_layers}")
    if any("mtp" in stage for stage in names):
        raise ValueError("multi-token prediction layers (m) are not supported")
    if "embedding" not in names[0] or "loss" not in names[-1]:
        raise ValueError("the embedding (E) must be on the first stage and the loss (L) on the last")


def _check_counts(args: argparse.Namespace, uneven: List[str], counted: List[str]) -> None:
    """Megatron-LM's divisibility rules for the uneven and the counted splits (ValueError)."""
    n, pp = args.num_layers, args.pipeline_model_parallel_size
    if counted:  # validate_args: the layers plus the counted embedding / loss split evenly
        total = n + len(counted)
        if total % pp:
            raise ValueError(f"--num-layers {n} plus the {len(counted)} counted as layers ({total}) is not "
                             f"divisible by --pipeline-model-parallel-size {pp}")
        return
    ends = [v for v in (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) if v is not None]
    rest, stages = n - sum(ends), pp - len(ends)
    if stages and rest <= 0 or not stages and rest:  # megatron-core: middle stages hold >= 1 layer
        raise ValueError(f"num_layers ({n}) less the first/last stage's ({ends}) leaves {rest} layer(s) for the "
                         f"other {stages} stage(s)")
    if stages and rest % stages:
        raise ValueError(f"num_layers ({n}) less the first/last stage's ({ends}) is not divisible by the "
                         f"other {stages} stage(s)")


def _check_virtual(args: argparse.Namespace, counted: List[str]) -> None:
    """Megatron-LM's rule for the counted split with the interleaved schedule: a stage's units
    (layers plus the counted ones) divide into its model chunks (ValueError)."""
    per_stage = split_units(args) // args.pipeline_model_parallel_size
    vstages, vpl = args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage
    by, flag = (vstages, "--num-virtual-stages-per-pipeline-rank") if vstages is not None else \
        (vpl, "--num-layers-per-virtual-pipeline-stage")
    if per_stage % by:
        raise ValueError(f"the {per_stage} layers per stage ({len(counted)} of them counted) are not divisible "
                         f"by {flag} {by}")


def validate(args: argparse.Namespace) -> Optional[str]:
    """Megatron-LM's rules for the pipeline-split flags and this driver's refusals; returns
    None, or the one-line reason the command line is refused."""
    flags, pp = given(args), args.pipeline_model_parallel_size
    layout = args.pipeline_model_parallel_layout
    if layout is not None and (args.num_layers_per_virtual_pipeline_stage is not None
                               or args.num_virtual_stages_per_pipeline_rank is not None):
        return ("--pipeline-model-parallel-layout sets the virtual stages itself: give no "
                "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    if layout is not None and len(flags) > 1:  # megatron-core's TransformerConfig rule
        return f"--pipeline-model-parallel-layout cannot be set with {flags[0]}"
    uneven = [f for f in flags if f.startswith("--decoder-")]
    counted = [f for f in flags if f.startswith("--account-for-")]
    if uneven and counted:  # megatron-core's TransformerConfig rule
        return f"{uneven[0]} cannot be set with {counted[0]}"
    if not flags:
        return None
    if pp < 2 and uneven:  # counted layers and a one-stage layout are no-ops at PP=1 upstream too
        return f"{uneven[0]} needs --pipeline-model-parallel-size >= 2"
    interleaved = args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank
    if interleaved and not counted:
        return f"{flags[0]} with the interleaved schedule is not supported here (uneven virtual stages)"
    try:
        if layout is not None:
            _check_layout_string(layout, pp, args.num_layers)
        else:
            _check_counts(args, uneven, counted)
        if interleaved and pp > 1:
            _check_virtual(args, counted)
        stage_layers(args)
    except ValueError as e:
        return f"{flags[0]}: {e}"
    return None


def _expanded(layout: str) -> str:
    """A layout string with its repeats and commas written out (``"Et*2|tL"`` -> ``"Ett|tL"``),
    so that two spellings of one split record the same."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    char = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    return "|".join("".join(char[layer.name] for layer in stage)
                    for stage in PipelineParallelLayerLayout.parse_str_to_list(layout))


def record(args: argparse.Namespace) -> Dict[str, object]:
    """The split a checkpoint records: the flags' values (JSON types; a layout written out)."""
    out = {dest: getattr(args, dest, None) for dest in FLAGS}
    if out["pipeline_model_parallel_layout"] is not None:
        out["pipeline_model_parallel_layout"] = _expanded(out["pipeline_model_parallel_layout"])
    return out


def mismatch(saved: Optional[dict], now: Dict[str, object]) -> Optional[str]:
    """One line naming the first flag whose value differs from the checkpoint's record
    (None: same split, or a checkpoint written before the record existed)."""
    if not saved:
        return None
    show = lambda v: "off" if v is False else "on" if v is True else "none" if v is None else repr(v) \
        if isinstance(v, str) else str(v)
    for dest, flag in FLAGS.items():
        if saved.get(dest) != now.get(dest):
            return f"{flag} {show(now.get(dest))} (the checkpoint's: {show(saved.get(dest))})"
    return None


AUTO_MICROBATCHES = 256
"""Micro-batches of training documents ``--sb-auto-layout`` prices the stages over."""


def check_auto(args: argparse.Namespace) -> Optional[str]:
    """``--sb-auto-layout``'s requirements (after the predictor flags are checked); None or the
    one-line reason it is refused."""
    if not args.sb_auto_layout:
        return None
    if not args.sb_has_predictor:
        return ("--sb-auto-layout prices the stages with the latency predictor: give --sb-profile PATH "
                "or --sb-cost-model h100-analytic")
    if args.pipeline_model_parallel_size < 2:
        return "--sb-auto-layout needs --pipeline-model-parallel-size >= 2"
    if given(args):
        return f"--sb-auto-layout chooses the split itself: give no {given(args)[0]}"
    if args.num_layers_per_virtual_pipeline_stage is not None or args.num_virtual_stages_per_pipeline_rank:
        return "--sb-auto-layout with the interleaved schedule is not supported here (uneven virtual stages)"
    return None


def apply_auto(args: argparse.Namespace, predictor, lengths) -> str:
    """``--sb-auto-layout``: set the split flags to the one that equalises the predicted stage
    times over micro-batches of ``lengths`` (training documents in order, tokens; packed as
    :func:`sparsebalance.pipeline.split.pack_in_order`) and return the line that says so.
    A deterministic function of the flags, the predictor and the data, so every rank (and a
    resume) sets the same split. ValueError (one line) if megatron-core refuses it."""
    from sparsebalance.pipeline.split import megatron_flags, pack_in_order, propose_split, spread, stage_costs

    pp = args.pipeline_model_parallel_size
    mbs = pack_in_order(lengths, args.micro_batch_tokens, AUTO_MICROBATCHES)
    if not mbs:
        raise ValueError("--sb-auto-layout: the training split holds no document")
    topk = args.sb_topk if args.sparse_attention else None
    costs = stage_costs(predictor, mbs, pp, topk=topk)
    layers = propose_split(costs, args.num_layers)
    flags = megatron_flags(layers)
    for flag, value in zip(flags[::2], flags[1::2]):
        dest = next(d for d, f in FLAGS.items() if f == flag)
        setattr(args, dest, value if dest == "pipeline_model_parallel_layout" else int(value))
    error = validate(args)
    if error is not None:
        raise ValueError(f"--sb-auto-layout: {error}")
    ms = " ".join(f"{t:.3g}" for t in costs.stage_ms(layers))
    shown = " ".join(f"'{x}'" if "|" in x else x for x in flags) or "none (the even split)"
    return (f"--sb-auto-layout: stages hold {list(layers)} layers (predicted ms per micro-batch [{ms}], "
            f"slowest / fastest - 1 = {100 * spread(costs.stage_ms(layers)):.1f}%); flags: {shown}")
