"""Process group, model-parallel groups, seeds and the CPU bridge.

Launch with ``torchrun`` (one process per GPU, or per CPU rank); a plain
``python pretrain_gpt.py`` is a world of one. ``--distributed-timeout-minutes``
bounds every collective: a dead or stuck rank makes the others fail with an
error instead of hanging forever.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_cpu(args) -> bool:
    """Train on CPU: ``--cpu`` or no CUDA device."""
    return bool(args.cpu) or not torch.cuda.is_available()


def initialize(args) -> None:
    """Init torch.distributed + megatron parallel_state, install the CPU bridge, seed RNGs."""
    from megatron.core import parallel_state as ps

    from megatron.training.cpu_bridge import install_cpu_bridge

    cpu = use_cpu(args)
    install_cpu_bridge(force_cpu=cpu)
    if "RANK" not in os.environ:  # not under torchrun: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    backend = args.distributed_backend or ("gloo" if cpu else "nccl")
    if cpu and backend == "nccl":
        raise ValueError("--distributed-backend nccl needs CUDA; use gloo on CPU")
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if getattr(args, "deterministic_mode", False):
            deterministic_cuda()
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    torch.distributed.init_process_group(backend=backend, timeout=timeout)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        # no layer of the dense models trained here uses the expert groups (families.py)
        expert_tensor_parallel_size=getattr(args, "expert_tensor_parallel_size", None),
        distributed_timeout_minutes=max(1, int(round(args.distributed_timeout_minutes))),
    )
    set_seeds(args.seed, cpu)
    if cpu and getattr(args, "sequence_parallel", False):
        from megatron.training.cpu_bridge import install_cpu_rng_tracker

        install_cpu_rng_tracker()  # megatron forks it around dropout on sequence shards


DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""--deterministic-mode's settings on CUDA (Megatron-LM's): NCCL, Transformer Engine and cuBLAS
read them when first used, so they are set before the process group and any kernel; a
value the environment already holds wins."""


def deterministic_cuda() -> None:
    """``--deterministic-mode`` on CUDA (checked in compat.py: Transformer Engine's layers)."""
    for name, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)


def set_seeds(seed: int, cpu: bool) -> None:
    """Same seed on every rank: initial weights depend on the layout only through
    which layers a rank builds (use --load of one checkpoint to compare layouts)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not cpu:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Destroy process groups (clean exit, no gloo warnings)."""
    from megatron.core import parallel_state as ps

    if torch.distributed.is_initialized():
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
