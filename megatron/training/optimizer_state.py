"""How the optimizer's state goes into a checkpoint (``megatron/training/checkpointing.py``
writes and reads the files).

The model chunks and megatron-core's optimizer become one sharded state dict
(:func:`sharded_state`). Plain Adam's state is laid out per parameter, like the weights,
so it loads under any DP / TP / PP layout. The distributed optimizer's format is chosen
by :func:`content_metadata` (Megatron-LM's ``_build_sharded_state_dict_metadata``) and
recorded in the checkpoint as ``content_metadata``, so a load follows the checkpoint's own
format:

* ``dp_reshardable`` (Megatron-LM's default): each DP rank writes its buckets, without
  their DP padding; resumes with the same TP / PP, under any DP size.
* ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): the shards are gathered
  over DP and written per parameter with the parameter's own sharding; resumes under any
  DP, TP and PP. ``--distrib-optim-fully-reshardable-mem-efficient`` gathers onto DP rank 0
  over gloo instead of all-gathering (less memory, same content); on CPU that variant is
  always used, because the all-gather stages each shard with ``Tensor.cuda()``.

Without Apex / Transformer Engine (CPU, or a GPU install without them) megatron-core
0.16.1 keeps Adam's ``step`` in torch-Adam's per-parameter state, which two of its load
paths mishandle; :func:`allocate_distributed_optimizer_state`, :func:`restore_adam_steps`
and :func:`adam_step_kept` work around them (each says how).
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

DISTRIB_OPTIM_SHARDING = "dp_reshardable"
"""``--use-distributed-optimizer`` state format by default (megatron-core's
``metadata["distrib_optim_sharding_type"]``; see :func:`sharded_state`)."""
FULLY_RESHARDABLE = "fully_reshardable"
"""The format of ``--dist-ckpt-optim-fully-reshardable``."""


def content_metadata(fully_reshardable: bool = False, mem_efficient: bool = False) -> dict:
    """What megatron's ``sharded_state_dict`` methods are told about the checkpoint's
    layout (Megatron-LM's ``_build_sharded_state_dict_metadata``; stored in the checkpoint
    as ``content_metadata``). Read by the distributed optimizer only."""
    if not fully_reshardable:
        return {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING}
    return {"distrib_optim_sharding_type": FULLY_RESHARDABLE,
            "distrib_optim_fully_reshardable_mem_efficient": bool(mem_efficient)}


def sharded_state(model: List[torch.nn.Module], optimizer, is_loading: bool,
                  metadata: Optional[dict] = None) -> dict:
    """Model chunks and optimizer as megatron sharded state dicts.

    With the distributed optimizer each DP rank holds a shard of the optimizer state;
    ``metadata`` (:func:`content_metadata`; default ``DISTRIB_OPTIM_SHARDING``) picks how
    megatron writes it. Its default format in 0.16.1 (``fully_sharded_model_space``) is
    deprecated there and fails its own validation (``ShardedTensor.flattened_range is not
    supported``). With ``--overlap-param-gather`` the last step's updated parameters are
    still being gathered (the next forward would wait for them): gather them now, or ranks
    would save stale weights for the shards they do not own.
    """
    if not is_loading:
        for chunk in model:
            if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)
    elif optimizer is not None:
        allocate_distributed_optimizer_state(optimizer)
    state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model)}
    if optimizer is None:  # --no-save-optim / --no-load-optim: the model only
        return state
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=dict(metadata or content_metadata()))
    return state


def allocate_distributed_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet the state torch's Adam holds
    before its first step (zero moments, ``step`` 0), so megatron can describe the state
    it is about to load. Without Apex / Transformer Engine (CPU, or a GPU install without
    them) ``DistributedOptimizer.state_dict`` reads ``step`` from every parameter's state
    and asserts on an empty one (megatron-core 0.16.1); the loaded checkpoint then
    overwrites all of it. A no-op with Apex / TE and for the other optimizers."""
    from megatron.core.optimizer import distrib_optimizer as D

    if D.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, D.DistributedOptimizer) or len(opt.optimizer.state):
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                opt.optimizer.state[param]["step"] = torch.tensor(0.0)


def restore_adam_steps(optimizer) -> None:
    """After loading a distributed optimizer without Apex / TE, put the checkpoint's Adam
    step back into every parameter's torch-Adam state, one tensor each.

    megatron-core 0.16.1 (``DistributedOptimizer.load_state_dict``) restores the step
    into the param groups, writes it into the parameters' states as ONE shared tensor
    (which torch's Adam would then increment once per parameter each step), and then,
    copying the per-parameter state of the ``dp_reshardable`` format, overwrites it with
    the value the state had before the load (the step travels there as a
    ``LocalNonpersistentObject``): a resumed run restarts Adam's bias correction at 0.
    """
    from megatron.core.optimizer import distrib_optimizer as D

    if D.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, D.DistributedOptimizer):
            continue
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                state = opt.optimizer.state.get(param)
                if state is not None and "step" in group:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


@contextlib.contextmanager
def adam_step_kept(optimizer):
    """Inside: a distributed optimizer without Apex / TE loads ``fully_reshardable`` state.

    megatron-core 0.16.1 (``_set_main_param_and_optimizer_states``) copies every entry of a
    parameter's torch-Adam state from the loaded tensors, ``step`` included, but that format
    carries the step in the param groups only (KeyError 'step'). Here each parameter's own
    ``step`` is handed back to it (a no-op copy); :func:`restore_adam_steps` then sets it
    from the param groups. A no-op with Apex / TE and for the other optimizers."""
    from megatron.core.optimizer import distrib_optimizer as D

    patched = []
    if not D.HAVE_APEX_OR_TE:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if not isinstance(opt, D.DistributedOptimizer):
                continue
            real = opt._set_main_param_and_optimizer_states

            def with_step(model_param, tensors, _opt=opt, _real=real):
                group_index, group_order = _opt.model_param_group_index_map[model_param]
                own = _opt.optimizer.state[_opt.optimizer.param_groups[group_index]["params"][group_order]]
                if "step" in own and "step" not in tensors:
                    tensors = {**tensors, "step": own["step"]}
                return _real(model_param, tensors)

            opt._set_main_param_and_optimizer_states = with_step
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method
