"""The CPU bridge: which megatron modules it patches and what their torch view does."""

import pytest
import torch

from megatron.training import cpu_bridge


def test_view_maps_cuda_to_cpu_only():
    view = cpu_bridge._CpuTorchView()
    assert view.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert view.tensor([1.0], device=view.cuda.current_device()).device.type == "cpu"
    assert view.empty(3, device="cpu").device.type == "cpu"
    assert view.cuda.synchronize() is None
    assert view.float32 is torch.float32 and view.distributed is torch.distributed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bridge is only installed without CUDA")
def test_install_patches_exactly_the_documented_modules():
    assert cpu_bridge.install_cpu_bridge() is True
    names = cpu_bridge.bridged_modules()
    assert set(names) == {
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
    }
    for name in names:
        assert name.split("megatron.core.")[1].split(".")[-1] in cpu_bridge.__doc__
    import megatron.core.optimizer.optimizer as opt

    assert opt.clip_grad_by_total_norm_fp32 is cpu_bridge.cpu_clip_grad_by_total_norm_fp32
    import megatron.core.optimizer as optim

    assert optim.DistributedOptimizer is cpu_bridge._distributed_optimizer_on_cpu
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yarn

    assert yarn.get_pos_emb_on_this_cp_rank is cpu_bridge.cpu_pos_emb_on_this_cp_rank
    assert cpu_bridge.install_cpu_bridge() is True and cpu_bridge.bridged_modules() == names  # idempotent


@pytest.mark.parametrize("cp,rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_pos_emb_on_this_cp_rank(cp, rank):
    """Chunks r and 2 CP - 1 - r of 2 CP along the sequence, as megatron-core's index_select takes them."""
    group = type("G", (), {"size": lambda self: cp, "rank": lambda self: rank})()
    emb = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 1, 1, 3)
    per = 16 // (2 * cp)
    want = [*range(rank * per, (rank + 1) * per), *range((2 * cp - 1 - rank) * per, (2 * cp - rank) * per)]
    assert torch.equal(cpu_bridge.cpu_pos_emb_on_this_cp_rank(emb, 0, group), emb[want])


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_matches_torch(max_norm):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn_like(p)
    ref = [p.grad.clone() for p in ps]
    total = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in ref])))
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, g in zip(ref_params, ref):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    cpu_bridge.cpu_clip_grad_by_total_norm_fp32(ps, max_norm, total)
    for p, r in zip(ps, ref_params):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)


def test_cuda_type_names_only_while_active():
    """The distributed optimizer's constructor sees CUDA type names; nothing else does."""
    p32 = torch.nn.Parameter(torch.zeros(2))
    p16 = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    other = torch.zeros(2)
    with cpu_bridge._CudaTypeNames([p32, p16]):
        assert p32.type() == "torch.cuda.FloatTensor" and p16.type() == "torch.cuda.BFloat16Tensor"
        assert p32.type(torch.float64).dtype == torch.float64  # conversions untouched
        assert other.type() == "torch.FloatTensor"
    assert p32.type() == "torch.FloatTensor" and "type" not in p32.__dict__
