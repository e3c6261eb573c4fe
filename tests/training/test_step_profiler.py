"""Megatron-LM's ``--profile --use-pytorch-profiler``: the window's steps are profiled, their
kernel time split into attention and the rest, the trace written to ``--tensorboard-dir``
and the profiled steps left out of the summary's timing."""

import json
import os

from conftest import PRETRAIN, TINY, launch, summary_of


def test_pytorch_profiler_window(corpus, tmp_path):
    tb = tmp_path / "tb"
    flags = [*TINY, "--data-path", corpus, "--train-iters", "4", "--profile", "--use-pytorch-profiler",
             "--profile-step-start", "2", "--profile-step-end", "3", "--tensorboard-dir", str(tb),
             "--summary-json", str(tmp_path / "s.json")]
    proc = launch(PRETRAIN, flags)
    s = summary_of(proc)
    assert s["step_profiled_all"] == [False, False, True, False]
    assert s["profiled_steps"] == 1
    p = s["profile"]
    assert p["iterations"] == [3, 3] and p["device"] == "cpu"
    assert p["wall_ms"] > 0 and p["device_busy_ms"] is None  # no accelerator
    # the tiny model's dense attention is CPU SDPA: a part of the kernel time, not all of it
    assert 0 < p["attention_ms"] < p["kernel_ms"] and 0 < p["attention_share"] < 1
    # the breakdown by kernel class covers the whole kernel time; the linears are GEMMs on CPU too
    assert abs(sum(p["classes_ms"].values()) - p["kernel_ms"]) < 1e-6 and p["classes_ms"]["weight_gemm"] > 0
    assert p["idle_ms"] is None  # no device to wait
    assert os.path.basename(p["trace"]) == "profile_rank0_iter3-3.pt.trace.json"
    with open(p["trace"]) as fh:
        assert json.load(fh)["traceEvents"]
    assert "profile of iterations 3-3" in proc.stdout


def test_profile_window_must_be_ordered(corpus):
    proc = launch(PRETRAIN, [*TINY, "--data-path", corpus, "--train-iters", "2", "--profile",
                             "--profile-step-start", "3", "--profile-step-end", "3"])
    assert proc.returncode != 0
    assert "--profile-step-end 3 must be after --profile-step-start 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_device_busy_time_is_the_union_of_kernel_intervals():
    from types import SimpleNamespace as NS

    from megatron.training.profiling import device_busy_ms

    k = lambda a, b, dev="DeviceType.CUDA": NS(device_type=dev, time_range=NS(start=a, end=b))
    # overlapping kernels on two streams count once; a gap does not count; CPU ops are not kernels
    events = [k(0, 1000), k(500, 1500), k(3000, 3500), k(0, 9000, "DeviceType.CPU")]
    assert device_busy_ms(events) == 2.0
    assert device_busy_ms([k(0, 9000, "DeviceType.CPU")]) is None


def test_kernel_split_on_a_device_names_attention_and_host_waits():
    from types import SimpleNamespace as NS

    from megatron.training.profiling import kernel_split

    ev = lambda key, dev, dev_us=0.0, cpu_us=0.0, n=1: NS(key=key, device_type=f"DeviceType.{dev}", count=n,
                                                        self_device_time_total=dev_us, self_cpu_time_total=cpu_us)
    events = [ev("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90", "CUDA", 300.0),
              ev("nvjet_sm90_tst_256x160", "CUDA", 600.0), ev("triton_tem_fused_0", "CUDA", 100.0),
              ev("cudaLaunchKernel", "CPU", cpu_us=2000.0, n=50), ev("cudaStreamSynchronize", "CPU", cpu_us=700.0),
              ev("aten::item", "CPU", cpu_us=50.0, n=3), ev("aten::mm", "CPU", cpu_us=10.0)]
    out = kernel_split(events)
    assert out["device"] == "cuda" and out["kernel_ms"] == 1.0 and out["attention_ms"] == 0.4
    assert out["top_kernels"][0]["name"].startswith("nvjet")
    assert [h["name"] for h in out["top_host_ops"]][:2] == ["cudaLaunchKernel", "cudaStreamSynchronize"]
    assert out["top_host_ops"][0]["calls"] == 50
    assert out["host_sync_ms"] == 0.75  # the synchronize and the item, not the launches


def test_kernel_classes_of_a_training_step_add_up():
    from types import SimpleNamespace as NS

    from megatron.training.profiling import kernel_classes, kernel_split

    rows = [("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90", 400.0),  # FA4: attention, not a GEMM
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", 900.0),
            ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", 300.0), ("_route_kernel", 50.0),
            ("_lse_kernel", 70.0), ("_grad_kernel", 30.0),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", 40.0),
            ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", 20.0),
            ("multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>", 60.0),
            ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 25.0), ("Memcpy DtoD (Device -> Device)", 5.0),
            ("some_unknown_kernel_xyz", 1.0)]
    c = kernel_classes(rows)
    assert c == {"attention": 0.4, "routing": 0.05, "loss": 0.1, "weight_gemm": 1.2, "optimizer": 0.06,
                 "communication": 0.025, "memory": 0.005, "norm_elementwise": 0.06, "other": 0.001}
    ev = [NS(key=k, device_type="DeviceType.CUDA", count=1, self_device_time_total=us, self_cpu_time_total=0.0)
          for k, us in rows]
    out = kernel_split(ev)
    assert abs(sum(out["classes_ms"].values()) - out["kernel_ms"]) < 1e-9
