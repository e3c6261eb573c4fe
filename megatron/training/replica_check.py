"""Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval N``: every data-parallel
replica must hold the same weights. At the start of training and after every N-th
iteration each rank hashes each of its parameters (SHA-1 of the fp32 bytes, on the host)
and the hashes are all-gathered over the DP group; any difference stops the run with one
line naming the first parameter that differs.

megatron-core's ``check_param_hashes_across_dp_replicas`` does the same but moves the
hashes to CUDA for the all-gather; this one keeps them on the device the DP group's
backend uses (gloo: CPU), so it runs on both.
"""

from __future__ import annotations

import hashlib
from typing import List

import torch


class ReplicaMismatch(ValueError):
    """Parameters differ between data-parallel replicas (one line, exit 1, as any ValueError of a run)."""


def param_hashes(model: List[torch.nn.Module]) -> "tuple[list[str], torch.Tensor]":
    """``(names, hashes)``: each parameter's name (``chunk<i>.`` before it with virtual
    pipeline stages) and its SHA-1 digest as a
    ``[params, 20]`` uint8 tensor (fp32 bytes of the weights, so dtypes hash alike)."""
    names, digests = [], []
    for i, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            data = param.detach().float().cpu().contiguous().numpy()
            name = name.removeprefix("module.")  # megatron-core's DDP wrapper
            names.append(f"chunk{i}.{name}" if len(model) > 1 else name)
            digests.append(torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8))
    return names, torch.stack(digests) if digests else torch.zeros(0, 20, dtype=torch.uint8)


def check_weight_hashes(model: List[torch.nn.Module], iteration: int) -> None:
    """Raise :class:`ReplicaMismatch` unless every DP replica's parameters hash alike.

    With ``--overlap-param-gather`` the last step's updated shards are first gathered (as
    Megatron-LM does by disabling the forward pre-hook), or replicas would compare stale
    weights.
    """
    from megatron.core import parallel_state as ps

    for chunk in model:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    group = ps.get_data_parallel_group()
    names, local = param_hashes(model)
    if torch.distributed.get_backend(group) == "nccl":
        local = local.cuda()
    gathered = [torch.zeros_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(gathered, local, group=group)
    for replica, other in enumerate(gathered):
        differs = (other != local).any(dim=1).nonzero()
        if len(differs):
            raise ReplicaMismatch(f"--check-weight-hash-across-dp-replicas-interval: after iteration {iteration} "
                                  f"{names[int(differs[0])]} differs between this rank and DP rank {replica}")
