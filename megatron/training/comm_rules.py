"""Megatron-LM's rules for the communication / scheduling flags this driver accepts as
no-ops (``compat_table.NOOP``: same results here, whatever they say).

* ``--cp-comm-type`` / ``--hierarchical-context-parallel-sizes``: context parallelism here
  all-gathers keys and values per layer; Megatron-LM's p2p ring, all-to-all and hierarchical
  a2a+p2p compute the same attention. Its rules hold: the hierarchical sizes multiply to
  ``--context-parallel-size``, a2a+p2p needs them (``validate_args``), the types are one or
  one per layer (megatron-core's ``TransformerConfig``).
* ``--defer-embedding-wgrad-compute`` / ``--wgrad-deferral-limit``: the output layer's weight
  gradient is computed in each micro-batch's backward here instead of at the pipeline flush
  (the same sum). megatron-core's rules: a pipeline, gradient-accumulation fusion (not
  ``--no-gradient-accumulation-fusion``), a limit >= 0.
* ``--tp-comm-overlap`` (accepted without effect, one warning line: Transformer Engine's
  userbuffers are not set up here, the same results without the overlap): Megatron-LM's rule,
  it needs ``--sequence-parallel`` (which TP = 1 turns off).
* ``--num-distributed-optimizer-instances N``: the distributed optimizer shards its state over
  all DP x CP ranks (one instance), so gradients and updates are the same and each rank holds
  less optimizer state than with N instances (said in one warning line). Megatron-LM's rules:
  N > 1 needs ``--use-distributed-optimizer``; N divides DP x CP (``parallel_state``).

The values are the Megatron-LM flags' registered by :mod:`megatron.training.compat` (strings
as given).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, List, Optional

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""Megatron-LM's ``--cp-comm-type`` values (its help and megatron-core's attention)."""


def _given(args: argparse.Namespace, name: str):
    from megatron.training.compat import DEST_PREFIX

    return getattr(args, DEST_PREFIX + name, None)


def _ints(flag: str, words, usage_error: Callable[[str], Exception]) -> List[int]:
    out = []
    for word in [words] if isinstance(words, str) else words:
        try:
            out.append(int(word))
        except ValueError:
            raise usage_error(f"{flag}: invalid int value: {word!r}") from None
    return out


def validate(args: argparse.Namespace, usage_error: Callable[[str], Exception]) -> List[str]:
    """Check the rules above (``args`` with DP and CP resolved); returns warning lines, raises
    ``usage_error(one line)``."""
    _context_parallel(args, usage_error)
    _deferred_wgrad(args, usage_error)
    if _given(args, "tp_comm_overlap") and not args.sequence_parallel:
        raise usage_error("--tp-comm-overlap needs --sequence-parallel (with TP > 1): Megatron-LM overlaps TP "
                          "communication with the GEMMs only under sequence parallelism")
    return _optimizer_instances(args, usage_error)


def _context_parallel(args: argparse.Namespace, usage_error) -> None:
    cp = getattr(args, "context_parallel_size", 1) or 1
    types = _given(args, "cp_comm_type") or ["p2p"]  # Megatron-LM's default
    bad = [t for t in types if t not in CP_COMM_TYPES]
    if bad:
        raise usage_error(f"--cp-comm-type {bad[0]}: Megatron-LM's types are {', '.join(CP_COMM_TYPES)}")
    if cp > 1 and len(types) not in (1, args.num_layers):
        raise usage_error(f"--cp-comm-type gives {len(types)} types: one for every layer, or one per layer "
                          f"(--num-layers {args.num_layers}), as megatron-core requires")
    sizes = _given(args, "hierarchical_context_parallel_sizes")
    if sizes is not None:
        sizes = _ints("--hierarchical-context-parallel-sizes", sizes, usage_error)
        if math.prod(sizes) != cp:
            raise usage_error(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} multiply to "
                              f"{math.prod(sizes)}, not --context-parallel-size {cp} (as Megatron-LM asserts)")
    if "a2a+p2p" in types and sizes is None:
        raise usage_error("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (as in Megatron-LM)")


def _deferred_wgrad(args: argparse.Namespace, usage_error) -> None:
    limit = _given(args, "wgrad_deferral_limit")
    limit = 0 if limit is None else _ints("--wgrad-deferral-limit", limit, usage_error)[0]
    if not _given(args, "defer_embedding_wgrad_compute"):
        return  # megatron-core reads the limit only with deferral (it says so in its help)
    if args.pipeline_model_parallel_size == 1:
        raise usage_error("--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1 "
                          "(megatron-core refuses it without a pipeline)")
    if _given(args, "no_gradient_accumulation_fusion"):
        raise usage_error("--defer-embedding-wgrad-compute with --no-gradient-accumulation-fusion: megatron-core "
                          "defers the weight gradient only with gradient-accumulation fusion")
    if limit < 0:
        raise usage_error(f"--wgrad-deferral-limit {limit} must be >= 0 (0: every micro-batch deferred)")


def _optimizer_instances(args: argparse.Namespace, usage_error) -> List[str]:
    given: Optional[object] = _given(args, "num_distributed_optimizer_instances")
    n = 1 if given is None else _ints("--num-distributed-optimizer-instances", given, usage_error)[0]
    if n == 1:
        return []
    if n < 1:
        raise usage_error(f"--num-distributed-optimizer-instances {n} must be >= 1")
    if not args.use_distributed_optimizer:
        raise usage_error(f"--num-distributed-optimizer-instances {n} needs --use-distributed-optimizer "
                          "(as megatron-core asserts)")
    ranks = args.data_parallel_size * (getattr(args, "context_parallel_size", 1) or 1)
    if ranks % n:
        raise usage_error(f"--num-distributed-optimizer-instances {n} does not divide the {ranks} data-parallel x "
                          "context-parallel ranks (as Megatron-LM asserts)")
    return [f"--num-distributed-optimizer-instances {n}: the optimizer state is sharded over all {ranks} "
            f"data-parallel x context-parallel ranks here (one instance): the same gradients and updates, "
            f"1/{ranks} of the state per rank instead of Megatron-LM's {n}/{ranks}"]
