"""Run megatron-core's own pipeline schedules and optimizer on CPU (gloo).

megatron-core 0.16 is written for CUDA. Its 1F1B / interleaved schedules, p2p
layer and FP32 optimizer are device-agnostic except for a handful of spots that
name CUDA explicitly (measured on 0.16.1). We do NOT re-implement any of them; instead each patched
megatron module gets its own view of ``torch`` (:class:`_CpuTorchView`) in which

* ``torch.cuda.current_device()`` is the CPU device (p2p receive buffers),
* ``torch.cuda.synchronize()`` is a no-op (after batched p2p; gloo is synchronous),
* tensor factories given ``device="cuda"`` allocate on CPU (the schedules' token
  counter; the FP32 optimizer's scale / overflow scalars).

Everything else on the view is the real ``torch``. Only these modules see it:

==========================================  ====================================
module                                      why
==========================================  ====================================
``pipeline_parallel.p2p_communication``     receive buffers, synchronize
``pipeline_parallel.schedules``             ``total_num_tokens`` on ``"cuda"``
``distributed.param_and_grad_buffer``       DDP grad/param buffers on the current device
``models.common.embeddings.``               RoPE moves ``inv_freq`` to the current device
``rotary_pos_embedding``                    at the first forward
``models.common.embeddings.``               YaRN moves its two ``inv_freq`` tables there
``yarn_rotary_pos_embedding``               at its first (and every later) frequency build;
                                            its constructor's cos/sin cache takes this CP
                                            rank's share with a pinned index sent to CUDA:
                                            :func:`cpu_pos_emb_on_this_cp_rank` instead
``optimizer.optimizer``                     FP32 optimizer scalars on ``"cuda"``
``optimizer.distrib_optimizer``             distributed optimizer: the per-bucket
                                            scratch of its checkpoint code on the
                                            current device
``optimizer.clip_grads``                    ``count_zeros_fp32``'s counter on ``"cuda"``
                                            (``--log-num-zeros-in-grad``)
``tensor_parallel.mappings``                sequence parallelism: the all-gather /
                                            reduce-scatter outputs on the current device
``tensor_parallel.layers``                  sequence parallelism: the linears' gathered
                                            input and reduce-scattered grad on it
``utils``                                   ``GlobalMemoryBuffer`` (the linears' all-gather
                                            buffer under sequence parallelism) on it
==========================================  ====================================

The distributed optimizer (``--use-distributed-optimizer``) needs one more bridge.
Its constructor (and ``MixedPrecisionOptimizer``'s) sorts parameters by
``param.type()`` and accepts only ``'torch.cuda.FloatTensor'`` /
``'torch.cuda.HalfTensor'`` / ``'torch.cuda.BFloat16Tensor'``; a CPU parameter
reports ``'torch.FloatTensor'`` and is rejected. ``megatron.core.optimizer`` builds
it by the name ``DistributedOptimizer``; as that module sees it, the name is
:func:`_distributed_optimizer_on_cpu`, which constructs the real class while each
parameter answers ``type()`` with the CUDA name of its dtype (an attribute on the
parameter object, removed again when the constructor returns; nothing else sees
it). The rest of the path runs as is on gloo (measured on torch 2.13 / megatron-core
0.16.1): the grad buffers' ``reduce_scatter_tensor`` and the params'
``all_gather_into_tensor``, inside ``_coalescing_manager``, both synchronous and
with ``async_op=True`` (``--overlap-grad-reduce`` / ``--overlap-param-gather``:
gloo returns real work handles, and megatron's CUDA communication stream is
created only with ``num_distributed_optimizer_instances > 1``, which we never set).

Gradient clipping is the one place a device view is not enough:
``clip_grad_by_total_norm_fp32`` asserts ``param.grad.type() ==
'torch.cuda.FloatTensor'`` and the norm uses a CUDA multi-tensor kernel. We swap
the two functions *as the optimizer module sees them* for CPU versions with the
same semantics (global L2 norm: squares summed locally, all-reduced over the
optimizer's grad-stats group = model-parallel ranks, then every grad scaled by
``max_norm / (norm + 1e-6)`` when that is < 1). That keeps megatron's
``MegatronOptimizer.step()`` (grad copy, norm, clip, Adam, checkpoint
``sharded_state_dict``) in charge rather than a parallel CPU optimizer.

Sequence parallelism (``--sequence-parallel``, TP > 1) needs one more spot and no
collective. megatron-core forks its CUDA RNG tracker (``get_cuda_rng_tracker().fork()``)
around the dropout that runs on a sequence shard (the embedding's, and the transformer
block's); the fork needs a ``model-parallel-rng`` CUDA generator state, which a CPU run
cannot create. The driver trains without dropout, so :func:`install_cpu_rng_tracker`
makes the tracker megatron's own no-op one (``initialize_rng_tracker(inference_rng_tracker=
True)``: ``fork`` is a null context, ``add`` / ``set_states`` do nothing). The SP
collectives (``all_gather_into_tensor`` before the column-parallel linears and
``reduce_scatter_tensor`` after the row-parallel ones, both synchronous and, in the
linears' backward, ``async_op=True``; ``all_reduce`` of the norms' gradients over TP)
are gloo's own on torch 2.13: they return exactly what gathering and summing the ranks'
inputs by hand gives (``tests/training/test_sequence_parallel.py``), and the emulations a
bridge would use (all-reduce + narrow; all-gather into a list + cat) are not faster
(``benchmarks/bench_sp_collectives.py``, 2 ranks, 64 KB-4 MB per rank: each pair within the
run-to-run noise of the shared machine, 0.3 ms at 64 KB, 22-54 ms at 4 MB), so nothing is
bridged there. Only the buffers megatron allocates for them on ``torch.cuda.current_device()``
are placed on the CPU (the table). On GPU NCCL runs them as is.

The bridge is installed only when CUDA is unavailable or ``--cpu`` is given, and
is idempotent. :func:`bridged_modules` lists what was patched (tests assert it).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import types
from typing import Any, Iterator, List, Optional, Union

import torch

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "empty_like")
_PATCHED: list[str] = []


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec to CPU, leave everything else alone."""
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal, as torch.cuda.current_device() returns
        return torch.device("cpu")
    if torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda:
    """``torch.cuda`` as the patched modules see it."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """gloo collectives are complete when they return: nothing to wait for."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorchView(types.ModuleType):
    """The real ``torch`` except ``cuda`` and CUDA-placed tensor factories."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, self._wrap(getattr(torch, name)))

    @staticmethod
    def _wrap(fn):
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        factory.__name__ = fn.__name__
        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _local_grads(params: List[torch.nn.Parameter]) -> List[torch.Tensor]:
    from megatron.core.utils import to_local_if_dtensor

    return [to_local_if_dtensor(g).detach() for g in params]


def cpu_get_grad_norm_fp32(
    grads_for_norm: Union[List[torch.Tensor], torch.Tensor],
    norm_type: Union[int, float] = 2,
    grad_stats_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
) -> float:
    """Global grad norm (same contract as megatron's ``get_grad_norm_fp32``).

    ``grads_for_norm`` are this rank's grads already filtered by megatron (no
    shared or tensor-parallel duplicates); partial sums are combined across
    ``grad_stats_parallel_group`` so every rank gets the model-wide norm.
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = _local_grads(grads_for_norm)
    norm_type = float(norm_type)
    if norm_type == math.inf:
        local = max((g.abs().max().float() for g in grads), default=torch.zeros([]))
        total = torch.tensor([float(local)], dtype=torch.float64)
        torch.distributed.all_reduce(
            total, op=torch.distributed.ReduceOp.MAX, group=grad_stats_parallel_group
        )
        return float(total[0])
    # float64 accumulation: the norm must not depend on how layers are split into stages
    total = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        total += torch.linalg.vector_norm(g.double(), norm_type) ** norm_type
    torch.distributed.all_reduce(
        total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group
    )
    return float(total[0]) ** (1.0 / norm_type)


def cpu_clip_grad_by_total_norm_fp32(
    parameters: Union[List[torch.Tensor], torch.Tensor],
    max_norm: Union[int, float],
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale grads in place by ``max_norm / (total_norm + 1e-6)`` when that is < 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(_local_grads(grads), clip_coeff)


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


class _CudaTypeNames:
    """While active, each CPU parameter's ``type()`` (no arguments) answers the CUDA
    type name of its dtype; ``type(dtype)`` conversions are untouched. Implemented as
    an attribute on each parameter object (instance attributes shadow the method), so
    no other tensor, and nothing after ``__exit__``, sees it."""

    def __init__(self, params) -> None:
        self.params = [p for p in params if p.device.type == "cpu" and p.dtype in _CUDA_TYPE_NAMES]

    def __enter__(self) -> "_CudaTypeNames":
        for p in self.params:
            real = p.type
            name = _CUDA_TYPE_NAMES[p.dtype]
            p.type = lambda *args, _real=real, _name=name, **kwargs: (
                _real(*args, **kwargs) if args or kwargs else _name)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.params:
            del p.type


def _distributed_optimizer_on_cpu(optimizer, *args, **kwargs):
    """``DistributedOptimizer(optimizer, ...)`` for CPU parameters (module docstring)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [p for group in optimizer.param_groups for p in group["params"]]
    with _CudaTypeNames(params):
        return DistributedOptimizer(optimizer, *args, **kwargs)


def cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's ``get_pos_emb_on_this_cp_rank`` on CPU: the sequence cut into 2 x CP
    chunks, this rank keeping chunk ``r`` and chunk ``2 CP - 1 - r`` (the load-balanced split)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * size, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=seq_dim)


def cuda_bridge_needed(force_cpu: bool = False) -> bool:
    """True when megatron must run on CPU: ``--cpu`` or no usable CUDA device."""
    return force_cpu or not torch.cuda.is_available()


def install_cpu_bridge(force_cpu: bool = False) -> bool:
    """Patch the CUDA-only spots listed in the module docstring; returns whether it did.

    Args:
        force_cpu: install even if CUDA is available (``--cpu``).
    """
    if not cuda_bridge_needed(force_cpu):
        return False
    if _PATCHED:
        return True
    view = _CpuTorchView()
    for name in (
        "megatron.core.pipeline_parallel.p2p_communication",
        "megatron.core.pipeline_parallel.schedules",
        "megatron.core.distributed.param_and_grad_buffer",
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        "megatron.core.optimizer.optimizer",
        "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.optimizer.clip_grads",
        "megatron.core.tensor_parallel.mappings",
        "megatron.core.tensor_parallel.layers",
        "megatron.core.utils",
    ):
        module = importlib.import_module(name)
        module.torch = view
        _PATCHED.append(name)
    yarn = importlib.import_module("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    yarn.get_pos_emb_on_this_cp_rank = cpu_pos_emb_on_this_cp_rank
    opt = importlib.import_module("megatron.core.optimizer.optimizer")
    opt.get_grad_norm_fp32 = cpu_get_grad_norm_fp32
    opt.clip_grad_by_total_norm_fp32 = cpu_clip_grad_by_total_norm_fp32
    importlib.import_module("megatron.core.optimizer").DistributedOptimizer = _distributed_optimizer_on_cpu
    return True


@contextlib.contextmanager
def tied_embedding_sync_on_cpu() -> Iterator[None]:
    """Build a GPTModel with tied embeddings over pipeline stages on CPU.

    ``LanguageModule.setup_embeddings_and_output_layer`` (megatron-core 0.16.1) makes the last
    stage's output weight equal the first stage's word embeddings by an all-reduce over the
    embedding group, after moving the weight with ``Tensor.cuda()`` (a tensor method, out of
    reach of the module views above). While the chunks are built, ``Tensor.cuda`` leaves a
    tensor where it is (gloo reduces CPU tensors); it is put back at once. The gradients'
    all-reduce over the same group (``finalize_model_grads``) needs no CUDA."""
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real


def bridged_modules() -> tuple[str, ...]:
    """Names of the megatron modules whose ``torch`` is the CPU view."""
    return tuple(_PATCHED)


def install_cpu_rng_tracker() -> None:
    """megatron-core's no-op CUDA RNG tracker for a CPU run with sequence parallelism
    (module docstring); replaces any tracker built before."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
