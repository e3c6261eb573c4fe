"""Checkpoints with ``megatron.core.dist_checkpointing`` (torch_dist format), verified.

Layout (Megatron-LM's, plus a manifest)::

    <save>/latest_checkpointed_iteration.txt    iteration number, written atomically
    <save>/iter_0000100/                        dist_checkpointing directory
    <save>/iter_0000100/manifest.json           every other file's size and sha256

Saving: every rank writes into ``iter_XXXXXXX.tmp-<nonce>``; after all ranks finished,
the ranks hash the files (each a share), rank 0 writes ``manifest.json`` last (temp file
+ ``os.replace``), renames the directory into place, and only then replaces the
tracker. After each step that writes, the ranks agree (one all-gather) on whether any
of them failed, so a failure on one rank (disk full, unwritable ``--save``) is a
:class:`SaveError` on every rank instead of a hang; the partial directory is removed
and the previous checkpoint stays "latest".

Loading (:func:`choose_checkpoint`): the newest iteration up to the tracker's whose
files match its manifest (checked by all ranks, each hashing a share; every rank gets
the same verdict). A damaged one (manifest missing or unreadable, a file missing, of
another size or another checksum) is never loaded: the next older intact one is,
with one warning; none intact is a one-line ValueError. Checkpoints written before
manifests existed: if NO iteration directory under ``--load`` has a manifest, the
tracker's checkpoint is loaded unverified, with a warning; as soon as one has a
manifest, a missing manifest means damaged (an interrupted save).

Saved: every model chunk (``model0``, ``model1``, ... as sharded tensors with
global layer keys, so a checkpoint loads under another PP / VPP / DP layout),
megatron's optimizer state (``optimizer.sharded_state_dict``), the LR scheduler,
the iteration, the sampler state (resume continues the same data order) and, with a
SparseBalance predictor, its online recalibration state (``sparsebalance``: DST
budgets continue as in an uninterrupted run; see ``sparsebalance/balancer.py``).
No RNG state: training draws no random numbers (no dropout; the sampler is
seeded by (seed, epoch)).

The optimizer's state: plain Adam's per parameter (any layout on resume), the distributed
optimizer's ``dp_reshardable`` (Megatron-LM's default: another DP size) or, with
``--dist-ckpt-optim-fully-reshardable``, ``fully_reshardable`` (any DP, TP and PP); the
format is recorded as ``content_metadata`` and a load follows it
(:mod:`megatron.training.optimizer_state`). Switching ``--use-distributed-optimizer`` on
resume is a one-line "does not match" error (``--finetune`` takes the weights of either into
any layout). The sampler continues under another DP size when the global batch is unchanged
(it re-partitions the remaining documents;
:meth:`sparsebalance.batching.sampler.PackingSampler.load_state_dict`). ``args`` holds the
run's model flags (``--use-checkpoint-args``). Megatron-LM's legacy ``--ckpt-format torch``
checkpoints load through :mod:`megatron.training.legacy_checkpoint`.

Why a custom save strategy: megatron's default torch_dist save hands the
writing to worker processes (``FileSystemWriterAsync.write_preloaded_data_multiproc``)
that hung on CPU/gloo here (measured on 0.16.1, with and without a ``__main__``
guard). :class:`SyncTorchDistSaveStrategy` keeps megatron's translation of
sharded tensors and its save planner, and writes in-process with
``torch.distributed.checkpoint.save``; the result is the same torch_dist format,
read back by megatron's default ``TorchDistLoadShardedStrategy``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from typing import Callable, Dict, List, Optional

import torch

from megatron.training.legacy_checkpoint import is_legacy, load_legacy, load_legacy_weights
from megatron.training.optimizer_state import (
    FULLY_RESHARDABLE,
    adam_step_kept,
    content_metadata,
    restore_adam_steps,
    sharded_state,
)
from sparsebalance.io import atomic_write_text

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "sparsebalance-checkpoint-manifest"
MANIFEST_VERSION = 1
# sha256, not blake2b: hashlib's sha256 is OpenSSL's, which uses the SHA extensions of
# current server CPUs (2.1 GB/s vs blake2b's 1.4 GB/s on the AMD EPYC this was written
# on), and ``sha256sum`` checks a manifest entry by hand.
CHECKSUM = "sha256"
_ITER_DIR = re.compile(r"iter_(\d{7})")

Warn = Optional[Callable[[str], None]]


class SaveError(ValueError):
    """A checkpoint could not be written (one line naming the path and the cause);
    raised on every rank. The previous checkpoint is untouched."""


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


def list_iterations(root: str) -> List[int]:
    """Iterations with an ``iter_XXXXXXX`` directory under ``root``, ascending (never the
    ``.tmp-`` directories of a save in progress)."""
    if not os.path.isdir(root):
        return []
    found = (_ITER_DIR.fullmatch(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


# ---- manifest ------------------------------------------------------------------------

def _files(path: str) -> List[str]:
    """Every file under ``path`` except the manifest, relative, sorted."""
    names = []
    for d, _, files in os.walk(path):
        names += [os.path.relpath(os.path.join(d, f), path).replace(os.sep, "/") for f in files]
    return sorted(n for n in names if n != MANIFEST and not n.startswith(f".{MANIFEST}"))


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, CHECKSUM).hexdigest()


def _describe(path: str, names: List[str]) -> Dict[str, dict]:
    return {n: {"size": os.path.getsize(os.path.join(path, n)), CHECKSUM: _digest(os.path.join(path, n))}
            for n in names}


def write_manifest(path: str, iteration: int, files: Dict[str, dict]) -> None:
    """Write ``path/manifest.json`` atomically (``sparsebalance.io``: temp file, fsync, rename)."""
    doc = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "iteration": iteration,
           "checksum": CHECKSUM, "files": files}
    atomic_write_text(os.path.join(path, MANIFEST), json.dumps(doc, indent=1, sort_keys=True))


def seal_checkpoint(path: str, iteration: int) -> None:
    """Write the manifest of every file now in the single-writer checkpoint ``path``
    (tools that write a checkpoint in one process, e.g. tools/checkpoint/convert.py)."""
    write_manifest(path, iteration, _describe(path, _files(path)))


def _read_manifest(path: str, iteration: int) -> dict:
    """The manifest's ``files`` table; ValueError (the reason) if it is missing or bad."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise ValueError(f"no {MANIFEST}" if os.path.isdir(path) else "directory missing")
    try:
        with open(file) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{MANIFEST} unreadable: {' '.join(str(e).split())[:120]}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{MANIFEST} is not a {MANIFEST_FORMAT}")
    if doc.get("version") != MANIFEST_VERSION or doc.get("checksum") != CHECKSUM:
        raise ValueError(f"{MANIFEST} has version {doc.get('version')!r} / checksum {doc.get('checksum')!r}; "
                         f"this code reads version {MANIFEST_VERSION} / {CHECKSUM}")
    if doc.get("iteration") != iteration:
        raise ValueError(f"{MANIFEST} is for iteration {doc.get('iteration')!r}")
    files = doc.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{MANIFEST} lists no files")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get(CHECKSUM), str)):
            raise ValueError(f"{MANIFEST} entry {name!r} has no size and {CHECKSUM}")
    return files


def check_checkpoint(path: str, iteration: int, share: int = 0, shares: int = 1,
                     hashes: bool = True) -> Optional[str]:
    """Why the checkpoint directory ``path`` is damaged, or None if it is intact.

    Checks the manifest, that every listed file exists with its size, and (``hashes``)
    the checksums of the files ``share``, ``share + shares``, ... of the sorted list
    (ranks split the reading). Files not in the manifest are ignored.
    """
    try:
        files = _read_manifest(path, iteration)
        for name in sorted(files):
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                return f"{name} missing"
            size = os.path.getsize(file)
            if size != files[name]["size"]:
                return f"{name} has {size} bytes, manifest says {files[name]['size']}"
        if hashes:
            for name in sorted(files)[share::shares]:
                if _digest(os.path.join(path, name)) != files[name][CHECKSUM]:
                    return f"{name} fails its {CHECKSUM} check"
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"unreadable: {e}"
    return None


def _has_manifest(root: str, iteration: int) -> bool:
    return os.path.isfile(os.path.join(iter_dir(root, iteration), MANIFEST))


# ---- agreement between ranks -----------------------------------------------------------

def _rank_world() -> tuple:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    """Every rank's ``obj`` (rank order), on every rank."""
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _from_rank0(obj):
    return _gather(obj)[0]


def _agree(error: Optional[str]) -> Optional[str]:
    """The first rank's error (in rank order), or None if no rank had one."""
    return next((e for e in _gather(error) if e is not None), None)


def _cause(e: BaseException) -> str:
    """First line of an exception's text; through torch.distributed.checkpoint's wrapper
    (whose text is every rank's traceback) to the first failed rank's own exception."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return _cause(next(iter(failures.values()))[0])
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _errors() -> tuple:
    """What a save or load step can raise: torch's CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _step(fn: Callable[[], None], path: Optional[str] = None) -> Optional[str]:
    """Run this rank's part of a save step; every rank then learns whether any failed.
    Catches every error, not only OSError: a rank that raised past the agreement would
    leave the others waiting in it. ``path``: where the step writes (a full disk is then
    named ENOSPC with that path, whatever the writer said)."""
    from megatron.training.failsafe import disk_full

    error = None
    try:
        fn()
    except _errors() as e:
        error = _cause(e)
        if path is not None and "ENOSPC" not in error and disk_full(e, path):
            error = f"{error} (ENOSPC: no space left on device writing {path})"
    return _agree(error)


# ---- choosing what to load ---------------------------------------------------------------

def choose_checkpoint(root: str, warn: Warn = None) -> int:
    """The iteration to load from ``root`` (collective: every rank gets the same answer).

    The newest intact iteration up to the tracker's; ``warn`` (rank 0's) gets one line when
    that is not the tracker's. ValueError (one line) when none is intact.
    """
    rank, world = _rank_world()
    latest = read_tracker(root)
    if latest is None:
        raise ValueError(f"--load: no checkpoint in {root} (missing {TRACKER})")
    iterations = list_iterations(root)
    candidates, legacy = _from_rank0(([i for i in iterations if i <= latest],
                                      not any(_has_manifest(root, i) for i in iterations)))
    name = os.path.basename(iter_dir(root, latest))
    if legacy:  # saved before manifests existed (see module docstring)
        if warn:
            warn(f"checkpoint {name} in {root} has no {MANIFEST} (written before integrity checks, "
                 f"or by another tool); loading it unverified")
        return latest
    damaged = []
    for i in reversed(candidates):
        reason = _agree(check_checkpoint(iter_dir(root, i), i, share=rank, shares=world))
        if reason is None:
            if damaged and warn:
                more = f" (also damaged: {', '.join(n for n, _ in damaged[1:])})" if len(damaged) > 1 else ""
                warn(f"checkpoint {damaged[0][0]} is damaged ({damaged[0][1]}); "
                     f"loading {os.path.basename(iter_dir(root, i))}{more}")
            return i
        damaged.append((os.path.basename(iter_dir(root, i)), reason))
    listed = "; ".join(f"{n} is damaged ({r})" for n, r in damaged)
    raise ValueError(f"--load: no intact checkpoint in {root}: {listed}")


def remove_old_checkpoints(root: str, keep: int, newest: int) -> List[str]:
    """Delete the iteration directories under ``root`` older than the newest ``keep``
    intact ones at or below ``newest`` (the one just saved); returns their names.

    Rank 0 only, after a save returned (so never during one of ours; ``.tmp-``
    directories are never touched). "Intact" here is the manifest + file sizes check
    (no hashing: the load verifies checksums). Fewer than ``keep`` intact: nothing is
    deleted, so the only intact checkpoint always survives. Directories newer than
    ``newest`` (e.g. a damaged one that a fallback skipped) are left alone.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    iterations = [i for i in list_iterations(root) if i <= newest]
    kept = []
    for i in reversed(iterations):
        if check_checkpoint(iter_dir(root, i), i, hashes=False) is None:
            kept.append(i)
            if len(kept) == keep:
                break
    if len(kept) < keep:
        return []
    removed = [os.path.basename(iter_dir(root, i)) for i in iterations if i < kept[-1]]
    for name in removed:
        shutil.rmtree(os.path.join(root, name))
    return removed


def remove_checkpoint(root: str, iteration: int) -> None:
    """Delete the iteration directory of ``iteration`` under ``root`` (rank 0, after a save)."""
    shutil.rmtree(iter_dir(root, iteration))


# ---- save --------------------------------------------------------------------------------

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


def _write_state(state: dict, path: str, cpu: bool) -> Optional[str]:
    """``megatron.core.dist_checkpointing.save`` (synchronous) step by step, with the
    ranks agreeing after each write: rank 0's ``common.pt``, every rank's shards, rank 0's
    ``metadata.json``. Returns the first failure (same on every rank) or None."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_common_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    rank = _rank_world()[0]
    sharded_strategy = _sync_strategy() if cpu else get_default_save_sharded_strategy()
    assert sharded_strategy.can_handle_sharded_objects  # torch_dist writes them with the shards
    sharded, common = save_preprocess(state, validate_access_integrity=True)

    def write_common() -> None:  # rank 0 only (megatron's common strategy checks)
        get_default_save_common_strategy().save_common(common, path)

    def write_shards() -> None:
        sharded_strategy.save(sharded, path)

    def write_config() -> None:
        if rank == 0:
            save_config(CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version), path)

    return _step(write_common, path) or _step(write_shards, path) or _step(write_config, path)


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, loader, cpu: bool,
                    balancer=None, save_optim: bool = True, settings: Optional[dict] = None,
                    metadata: Optional[dict] = None, model_args: Optional[dict] = None,
                    split: Optional[dict] = None) -> str:
    """Write iteration ``iteration`` under ``root`` (all ranks call this); returns its path.

    ``balancer``: the run's :class:`sparsebalance.balancer.Balancer` (None: no
    predictor); its online state goes into the common state as ``sparsebalance``.
    ``save_optim`` False (``--no-save-optim``): no optimizer state and no LR schedule.
    ``settings``: the run's sparse-attention / SparseBalance settings
    (:func:`megatron.training.preflight.run_settings`), compared on resume.
    ``metadata``: the optimizer-state format (:func:`content_metadata`; default
    ``dp_reshardable``), recorded as the checkpoint's ``content_metadata``.
    ``model_args``: the run's model flags (``args`` in the checkpoint, read by
    ``--use-checkpoint-args``; :mod:`megatron.training.checkpoint_args`).
    ``split``: the run's pipeline-split flags (:func:`megatron.training.pipeline_layout.record`),
    checked on resume.

    Raises :class:`SaveError` on every rank if any rank failed to write, or if any rank's
    weights hold a NaN / Inf (nothing is written then); the partial directory is removed
    and the tracker still names the previous checkpoint.
    """
    from megatron.training.failsafe import nonfinite_parameter

    rank, world = _rank_world()
    bad = _agree(nonfinite_parameter(model))
    if bad is not None:
        raise SaveError(f"not saving checkpoint {os.path.basename(iter_dir(root, iteration))} to {root}: "
                        f"{bad} holds non-finite values (NaN/Inf)")
    nonce = _from_rank0(uuid.uuid4().hex[:8])  # one temp directory for all ranks
    final = iter_dir(root, iteration)
    tmp = f"{final}.tmp-{nonce}"

    def fail(cause: str) -> SaveError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return SaveError(f"saving checkpoint {os.path.basename(final)} to {root} failed: {cause}")

    def make_dir() -> None:
        if rank == 0:
            os.makedirs(tmp, exist_ok=False)

    error = _step(make_dir)
    if error:
        raise fail(error)
    metadata = dict(metadata or content_metadata())
    if save_optim:
        sharding = dict(metadata)
        if cpu and sharding["distrib_optim_sharding_type"] == FULLY_RESHARDABLE:
            # megatron's all-gather variant stages each shard with ``Tensor.cuda()``; its
            # gloo variant (gather onto DP rank 0) writes the same checkpoint content
            sharding["distrib_optim_fully_reshardable_mem_efficient"] = True
        state = sharded_state(model, optimizer, is_loading=False, metadata=sharding)
        state.update(scheduler=scheduler.state_dict())
    else:
        state = sharded_state(model, None, is_loading=False)
    state.update(iteration=iteration, sampler=loader.state_dict(), optimizer_saved=save_optim,
                 content_metadata=metadata)
    if model_args is not None:
        state["args"] = model_args
    if settings is not None:
        state["settings"] = settings
    if split is not None:
        state["pipeline_split"] = split
    if balancer is not None:  # identical on every rank: rank 0's common.pt holds it
        state["sparsebalance"] = balancer.state_dict()
    error = _write_state(state, tmp, cpu)
    if error:
        raise fail(error)
    # Every rank has finished writing: each hashes a share of the files, rank 0 writes the
    # manifest last, renames the directory into place, then moves the tracker.
    names = _from_rank0(_files(tmp) if rank == 0 else None)
    described = {}
    error = _step(lambda: described.update(_describe(tmp, names[rank::world])))
    if error:
        raise fail(error)
    files = {k: v for part in _gather(described) for k, v in part.items()}

    def publish() -> None:
        if rank == 0:
            _publish(root, iteration, tmp, files, nonce)

    error = _step(publish)
    if error:
        raise fail(error)
    return final


def _publish(root: str, iteration: int, tmp: str, files: Dict[str, dict], nonce: str) -> None:
    """Rank 0: manifest into ``tmp``, ``tmp`` -> ``iter_XXXXXXX``, then the tracker."""
    write_manifest(tmp, iteration, files)
    final = iter_dir(root, iteration)
    if os.path.isdir(final):  # re-saving an iteration: swap, then drop the old one
        old = f"{final}.old-{nonce}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")


# ---- load --------------------------------------------------------------------------------

def _load(state: dict, path: str, what: str) -> dict:
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load(state, path)
    except _errors() as e:  # a shape/key mismatch surfaces as megatron CheckpointingException etc.
        raise ValueError(f"--load: checkpoint {path} does not match this {what}: {_cause(e)}") from None


def load_checkpoint(root: str, model, optimizer, scheduler, loader, warn: Warn = None,
                    balancer=None, load_optim: bool = True, settings: Optional[dict] = None,
                    split: Optional[dict] = None, model_args: Optional[dict] = None) -> int:
    """Load the newest intact checkpoint under ``root`` (:func:`choose_checkpoint`) into
    everything (``balancer``: the SparseBalance predictor state, when the run has one);
    returns its iteration. ``load_optim`` False (``--no-load-optim``): the optimizer state
    and LR schedule start fresh (Megatron-LM's meaning). ``settings``: this run's
    (:func:`megatron.training.preflight.run_settings`): ``warn`` gets one line per setting
    that differs from the checkpoint's. ``split``: this run's pipeline-split flags
    (:func:`megatron.training.pipeline_layout.record`), which must be the checkpoint's: each
    stage's layers set its predictor corrections and DST plans (``--finetune`` takes the
    weights under any split). ``model_args``: this run's model flags
    (:func:`megatron.training.checkpoint_args.saved_args`), whose YaRN positions must be the
    checkpoint's (:func:`~megatron.training.checkpoint_args.changed_positions`).

    The LR schedule follows Megatron-LM's resume rule
    (:func:`megatron.training.lr_schedule.resume_schedule`, with the scheduler's
    override / use-checkpoint flags); rank 0 prints the line saying which one is used
    when the command line's differs from the checkpoint's.

    Raises ValueError (one line) when ``root`` holds no intact checkpoint, it does not
    match the model, or its schedule differs and no rule flag says which one to use.
    """
    from megatron.core import dist_checkpointing

    from megatron.training.lr_schedule import resume_schedule

    path = iter_dir(root, choose_checkpoint(root, warn))
    if is_legacy(path):  # Megatron-LM's --ckpt-format torch
        return load_legacy(path, model, optimizer, scheduler, warn, load_optim, balancer=balancer)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except _errors() as e:
        raise ValueError(f"--load: checkpoint {path} is unreadable: {_cause(e)}") from None
    if split is not None:
        from megatron.training.pipeline_layout import mismatch

        changed = mismatch(common.get("pipeline_split"), split)
        if changed is not None:
            raise ValueError(f"--load: checkpoint {path} was trained with another pipeline split: resuming with "
                             f"{changed}; give the checkpoint's split flags, or --finetune to take only the weights")
    if model_args is not None:
        from megatron.training.checkpoint_args import changed_positions

        changed = changed_positions(common.get("args"), model_args)
        if changed is not None:
            raise ValueError(f"--load: checkpoint {path} was trained with other positions: resuming with {changed}; "
                             "give the checkpoint's position flags, or --finetune to take only the weights")
    if warn is not None and settings is not None:
        from megatron.training.preflight import changed_settings

        for line in changed_settings(common.get("settings"), settings):
            warn(line)
    if load_optim and common.get("optimizer_saved", True) is False:
        raise ValueError(f"--load: checkpoint {path} was saved with --no-save-optim (no optimizer state): "
                         "resume with --no-load-optim, or --finetune")
    schedule_line = resume_schedule(scheduler, common["scheduler"]) if load_optim else None
    # the checkpoint's own optimizer format (none recorded: written before the choice existed)
    metadata = common.get("content_metadata") or content_metadata()
    state = sharded_state(model, optimizer if load_optim else None, is_loading=True, metadata=metadata)
    state.update(iteration=None, sampler=None, **({"scheduler": None} if load_optim else {}))
    loaded = _load(state, path, "model/layout")
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if load_optim:
        with torch.no_grad(), adam_step_kept(optimizer):  # fp32 main params are views of the weights
            optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["scheduler"])
        if schedule_line is not None and _rank_world()[0] == 0:  # an info line: the user chose it
            print(schedule_line, flush=True)
    try:
        loader.load_state_dict(loaded["sampler"])
    except ValueError as e:  # e.g. resumed with another DP size or --seq-length
        raise ValueError(f"--load: the data order saved in {path} was planned for another setup "
                         f"({e}); use --finetune to take only the weights") from None
    if balancer is not None:  # absent in older checkpoints: Balancer warns and starts fresh
        balancer.load_state_dict(loaded.get("sparsebalance"), warn=warn)
    return int(loaded["iteration"])


def load_weights(root: str, model, warn: Warn = None) -> int:
    """``--finetune``: load only the model weights of the newest intact checkpoint (any
    layout); optimizer, scheduler and data order start fresh. Returns its iteration."""
    iteration = choose_checkpoint(root, warn)
    if is_legacy(iter_dir(root, iteration)):
        load_legacy_weights(iter_dir(root, iteration), model)
        return iteration
    state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model)}
    loaded = _load(state, iter_dir(root, iteration), "model")
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    return iteration
