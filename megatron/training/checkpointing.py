"""Checkpoints with ``megatron.core.dist_checkpointing`` (torch_dist format).

Layout (Megatron-LM's)::

    <save>/latest_checkpointed_iteration.txt    iteration number, written atomically
    <save>/iter_0000100/                        dist_checkpointing directory

A checkpoint is written into ``iter_XXXXXXX.tmp-<nonce>`` and renamed into place by
rank 0 after every rank finished writing; the tracker file is replaced (temp
file + ``os.replace``) only after that. A crash at any point leaves either the
previous checkpoint or the new one as "latest", never a partial one.

Saved: every model chunk (``model0``, ``model1``, ... as sharded tensors with
global layer keys, so a checkpoint loads under another PP / VPP / DP layout),
megatron's optimizer state (``optimizer.sharded_state_dict``), the LR scheduler,
the iteration, and the sampler state (resume continues the same data order).
No RNG state: training draws no random numbers (no dropout; the sampler is
seeded by (seed, epoch)).

Why a custom save strategy: megatron's default torch_dist save hands the
writing to worker processes (``FileSystemWriterAsync.write_preloaded_data_multiproc``)
that hung on CPU/gloo here (measured on 0.16.1, with and without a ``__main__``
guard). :class:`SyncTorchDistSaveStrategy` keeps megatron's translation of
sharded tensors and its save planner, and writes in-process with
``torch.distributed.checkpoint.save``; the result is the same torch_dist format,
read back by megatron's default ``TorchDistLoadShardedStrategy``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import List, Optional

import torch

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """Latest complete iteration saved under ``root``, or None if there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"checkpoint tracker {path} is corrupt: {text[:40]!r}")
    iteration = int(text)
    if not os.path.isdir(iter_dir(root, iteration)):
        raise ValueError(f"checkpoint tracker {path} names iteration {iteration} but "
                         f"{iter_dir(root, iteration)} is missing")
    return iteration


def _sync_strategy():
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    class SyncTorchDistSaveStrategy(mtorch.TorchDistSaveShardedStrategy):
        """torch_dist save without worker processes (see module docstring)."""

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            from torch.distributed.checkpoint import FileSystemWriter, save

            sd, _, _ = mtorch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            save(
                mtorch.mcore_to_pyt_state_dict(sd, False),
                storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=mtorch.MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
                ),
            )

    return SyncTorchDistSaveStrategy("torch_dist", 1)


def _sharded_state(model: List[torch.nn.Module], optimizer, is_loading: bool) -> dict:
    state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, loader, cpu: bool) -> str:
    """Write iteration ``iteration`` under ``root`` atomically (all ranks call this)."""
    from megatron.core import dist_checkpointing

    rank = torch.distributed.get_rank()
    # One nonce for all ranks, chosen by rank 0.
    nonce = [uuid.uuid4().hex[:8] if rank == 0 else None]
    torch.distributed.broadcast_object_list(nonce, src=0)
    final = iter_dir(root, iteration)
    tmp = f"{final}.tmp-{nonce[0]}"
    if rank == 0:
        os.makedirs(tmp, exist_ok=False)
    torch.distributed.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state.update(iteration=iteration, scheduler=scheduler.state_dict(), sampler=loader.state_dict())
    dist_checkpointing.save(state, tmp, sharded_strategy=_sync_strategy() if cpu else None)
    torch.distributed.barrier()
    if rank == 0:
        if os.path.isdir(final):  # re-saving an iteration: swap, then drop the old one
            old = f"{final}.old-{nonce[0]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        tracker_tmp = os.path.join(root, f".{TRACKER}.tmp-{nonce[0]}")
        with open(tracker_tmp, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    torch.distributed.barrier()
    return final


def load_checkpoint(root: str, model, optimizer, scheduler, loader) -> int:
    """Load the latest checkpoint under ``root`` into everything; returns its iteration.

    Raises ValueError (one line) when ``root`` holds no complete checkpoint or it
    does not match the model.
    """
    from megatron.core import dist_checkpointing

    iteration = read_tracker(root)
    if iteration is None:
        raise ValueError(f"--load: no checkpoint in {root} (missing {TRACKER})")
    path = iter_dir(root, iteration)
    state = _sharded_state(model, optimizer, is_loading=True)
    state.update(iteration=None, scheduler=None, sampler=None)
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as e:  # a shape/key mismatch surfaces as megatron CheckpointingException etc.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--load: checkpoint {path} does not match this model/layout: {first[:300]}") from None
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    try:
        loader.load_state_dict(loaded["sampler"])
    except ValueError as e:  # e.g. resumed with another DP size or --seq-length
        raise ValueError(f"--load: the data order saved in {path} was planned for another setup "
                         f"({e}); use --finetune to take only the weights") from None
    return int(loaded["iteration"])


def load_weights(root: str, model) -> int:
    """``--finetune``: load only the model weights of the latest checkpoint (any
    layout); optimizer, scheduler and data order start fresh. Returns its iteration."""
    from megatron.core import dist_checkpointing

    iteration = read_tracker(root)
    if iteration is None:
        raise ValueError(f"--load: no checkpoint in {root} (missing {TRACKER})")
    path = iter_dir(root, iteration)
    state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model)}
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--load: checkpoint {path} does not match this model: {first[:300]}") from None
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    return iteration
