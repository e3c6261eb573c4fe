"""Loading Megatron-LM's legacy per-rank checkpoints (``--ckpt-format torch``).

Layout (Megatron-LM's ``get_checkpoint_name``)::

    <load>/latest_checkpointed_iteration.txt
    <load>/iter_0000100/mp_rank_00/model_optim_rng.pt          TP rank 00, PP = 1
    <load>/iter_0000100/mp_rank_01_002/model_optim_rng.pt      TP rank 01, PP rank 002

Each file is a ``torch.save`` dict: ``model`` (``model0``, ``model1``, ... with virtual
stages), the TP/PP rank's model state dict with megatron-core's names, local layer
indices per stage; ``args`` (Megatron-LM's namespace), ``iteration``, ``checkpoint_version``,
``optimizer`` (megatron-core's ``optimizer.state_dict()``), ``opt_param_scheduler`` and
``rng_state``. Every rank reads its own TP/PP file, so the run must have the checkpoint's
TP and PP (the format is not reshardable; ``tools/checkpoint/convert.py`` or a torch_dist
save are). What comes over: the weights (Transformer Engine's fused layer-norm names
mapped to the local layers' ``input_layernorm`` / ``pre_mlp_layernorm``; TE's
``_extra_state`` entries dropped), the iteration, the plain optimizer's state and the LR
schedule. Not there, so starting fresh with one warning: the data position (the sampler
starts at the beginning of its data order) and SparseBalance's predictor state. A
distributed optimizer's legacy state (``distrib_optim.pt``, laid out for the saving run's
DP ranks) is not read: one line asks for ``--no-load-optim``. Saves always go out as
torch_dist (``megatron/training/checkpointing.py``).
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional, Tuple

import torch

FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3})?")
_TE_NAMES = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
             ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))
"""Transformer Engine spec's fused layer-norm names -> the local spec's modules."""


def is_legacy(path: str) -> bool:
    """Whether the iteration directory ``path`` is in the legacy per-rank layout."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "metadata.json")):
        return False
    return any(_RANK_DIR.fullmatch(n) for n in os.listdir(path))


def legacy_file(path: str, tp_rank: int, pp_rank: int, pp: Optional[int]) -> Optional[str]:
    """The file of TP rank ``tp_rank`` / PP rank ``pp_rank`` under ``path`` (``pp`` None:
    either naming), or None when the directory has no such file."""
    names = [f"mp_rank_{tp_rank:02d}", f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"]
    if pp is not None:
        names = names[1:] if pp > 1 else names[:1]
    for name in names:
        file = os.path.join(path, name, FILE)
        if os.path.isfile(file):
            return file
    return None


def _local_names(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A Megatron-LM model state dict in the local spec's names, without TE's extra state."""
    out = {}
    for name, value in state.items():
        if name.endswith("_extra_state"):
            continue
        for te, local in _TE_NAMES:
            if te in name:
                name = name.replace(te, local)
        out[name] = value
    return out


def _load_chunk(chunk: torch.nn.Module, state: Dict[str, torch.Tensor], file: str) -> None:
    mine = chunk.state_dict()
    theirs = _local_names(state)
    wanted = {k for k in mine if not k.endswith("_extra_state")}
    missing, unexpected = sorted(wanted - set(theirs)), sorted(set(theirs) - wanted)
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which this model does not"
        raise ValueError(f"--load: legacy checkpoint {file} does not match this model: it {what} "
                         f"({len(missing)} missing, {len(unexpected)} unexpected; pass the checkpoint's model "
                         "flags or --use-checkpoint-args)")
    for k in wanted:
        if tuple(theirs[k].shape) != tuple(mine[k].shape):
            raise ValueError(f"--load: legacy checkpoint {file} does not match this model: {k} is "
                             f"{tuple(theirs[k].shape)} there, {tuple(mine[k].shape)} here")
    chunk.load_state_dict({**mine, **{k: theirs[k] for k in wanted}}, strict=True)


def load_legacy_weights(path: str, model) -> Tuple[dict, str]:
    """This rank's file of the legacy checkpoint ``path`` loaded into ``model`` (DDP-wrapped
    chunks); returns the file's whole dict and its path. ValueError (one line) when this
    rank's file is missing or does not fit."""
    from megatron.core import parallel_state as ps

    tp_rank, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    file = legacy_file(path, tp_rank, ps.get_pipeline_model_parallel_rank(), pp)
    if file is None:
        raise ValueError(f"--load: legacy checkpoint {path} has no file for TP rank {tp_rank} of this PP={pp} "
                         "layout: resume with the checkpoint's --tensor-model-parallel-size and "
                         "--pipeline-model-parallel-size")
    try:  # Megatron-LM pickles its argparse namespace in every file
        state = torch.load(file, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"--load: legacy checkpoint {file} is unreadable: {' '.join(str(e).split())[:200]}") from None
    chunks = [state["model"]] if len(model) == 1 and "model" in state else \
        [state.get(f"model{i}") for i in range(len(model))]
    if any(c is None for c in chunks):
        raise ValueError(f"--load: legacy checkpoint {file} holds {sorted(k for k in state if k.startswith('model'))}, "
                         f"this run has {len(model)} model chunk(s) per rank")
    for chunk, sd in zip(model, chunks):
        _load_chunk(chunk.module, sd, file)
    return state, file


def load_legacy(path: str, model, optimizer, scheduler, warn, load_optim: bool, balancer=None) -> int:
    """Load the legacy checkpoint directory ``path`` (module docstring) into this rank's
    model chunks (``model``: DDP-wrapped), optimizer and scheduler; returns its iteration.
    ValueError (one line) when this rank's file is missing or does not fit."""
    from megatron.training.lr_schedule import resume_schedule

    state, file = load_legacy_weights(path, model)
    if load_optim:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer])):
            raise ValueError(f"--load: the distributed optimizer's state of legacy checkpoint {path} "
                             "(distrib_optim.pt) is not read here: resume with --no-load-optim")
        if "optimizer" not in state or "opt_param_scheduler" not in state:
            raise ValueError(f"--load: legacy checkpoint {file} has no optimizer state (saved with "
                             "--no-save-optim?): resume with --no-load-optim")
        line = resume_schedule(scheduler, state["opt_param_scheduler"])
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["opt_param_scheduler"])
        if line is not None and torch.distributed.get_rank() == 0:
            print(line, flush=True)
    if warn is not None:
        warn(f"legacy checkpoint {path} holds no data position: the data order starts from its beginning")
    if balancer is not None:
        balancer.load_state_dict(None, warn=warn)
    return int(state["iteration"])
