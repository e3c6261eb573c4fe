"""Shared pytest setup: the repo root is importable (``megatron.training``, ``sparsebalance``)."""

import os
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import megatron.training  # noqa: E402,F401  (before megatron-core: its fusion compiles are deferred)

# The experiment harnesses the tests run end to end start their training runs and tools forked
# from a warm process instead of as fresh interpreters (benchmarks/harness/forklaunch.py; its
# own tests hold the forks to the real processes): ~4 s of CPU saved a process.
os.environ.setdefault("SB_HARNESS_LAUNCH", "fork")

# The slowest test files (``pytest --durations`` on the 2-core machine, docs/results.md "Test
# suite timing"), slowest first. ``make test`` runs two pytest workers, each taking whole files
# (``--dist loadfile``) in collection order; these go first so that neither worker is left
# with a long file at the end while the other idles. Order only: a stale entry costs time,
# never a test.
SLOW_FIRST = (
    "benchmarks/test_heldout_loss.py",
    "benchmarks/longctx/test_longctx_recipe.py",
    "ops/test_route_kernels.py",
    "benchmarks/compare/test_real_smoke.py",
    "integration/test_bad_input.py",
    "benchmarks/test_fault_trials.py",
    "integration/test_slurm.py",
    "training/test_cp_training.py",
    "benchmarks/test_gpu_check.py",
    "training/test_driver_bad_input.py",
    "training/test_reshard_resume.py",
    "deploy/test_nvcc_compile.py",
    "checkpoint/test_real_finetune.py",
    "training/test_checkpoint_integrity.py",
    "integration/test_preemption.py",
    "ops/test_triton_backend.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {os.path.join(os.path.dirname(os.path.abspath(__file__)), f): i for i, f in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: files stay whole


def pytest_configure(config):
    # megatron-core warns once per module that TE/Apex are absent: expected on CPU.
    config.addinivalue_line("filterwarnings", "ignore:.*Transformer Engine and Apex are not installed.*")
    config.addinivalue_line("filterwarnings", "ignore:.*full scope is deprecated.*")


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """Warm rank processes that run scripts as torchrun would (tests/_world.py), started
    at the first job and shared by the session (one thread per rank, as the launches)."""
    from _world import World

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    w = World(str(tmp_path_factory.mktemp("world")), env)
    yield w
    w.close()


@pytest.fixture
def routing_counts(monkeypatch):
    """Routing skeleton builds and host copies of document boundaries made while a test
    runs (``counts["skeletons"]``, ``counts["copies"]()``), and ``counts["copied"]()``: the
    tensors in the host-copy cache. Both caches start empty."""
    from sparsebalance.ops import plan as plan_mod

    plan_mod._skeletons.clear()
    plan_mod._host_cu.clear()
    counts = {"skeletons": 0}
    build = plan_mod._build_skeleton

    def counting_build(*a, **k):
        counts["skeletons"] += 1
        return build(*a, **k)

    monkeypatch.setattr(plan_mod, "_build_skeleton", counting_build)
    start = plan_mod.host_copies()
    counts["copies"] = lambda: plan_mod.host_copies() - start
    counts["copied"] = plan_mod._host_cu.tensors
    return counts


@pytest.fixture(scope="module")
def mp():
    """A world of one (gloo) with megatron-core's model-parallel state, for building layers."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
