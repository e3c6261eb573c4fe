"""Shared pytest setup: the repo root is importable (``megatron.training``, ``sparsebalance``)."""

import os
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
