"""The fused routing (three Triton kernels) equals the torch route, run by Triton's CPU
interpreter, for top-k and threshold routing (per-head and per-block counts); fa4's
query-direction lists from its kernel equal the torch ones.

TRITON_INTERPRET must be set before triton is imported, so the outer test re-runs this
file in a child pytest with the variable set (and ``SPARSEBALANCE_ROUTE`` switched per
test), side by side with test_triton_backend.py's (``_interpreter.py``). The outer
process also compiles the kernels for sm_80 / sm_90 (what the interpreter never checks)
and tests the switch itself. Sizes are tiny: the interpreter is slow."""

import os
import re

import _interpreter
import pytest
import torch
from _cases import fused_descriptors_checked, make_inputs, plan_rows_checked, structured_inputs

# name -> (doc lengths, H, Hkv, D, block_size, topk)
CASES = {
    "ragged-gqa-single-tokens": ([200, 1, 40, 120, 17], 4, 2, 16, 16, 2),
    "one-long-doc": ([640], 2, 1, 8, 16, 3),
    "per-doc-budgets": ([100, 80, 301, 160], 3, 1, 8, 16, torch.tensor([2, 0, 5, 1])),
    "mha-odd-dim": ([250, 33], 2, 2, 24, 16, 4),
}

# name -> (doc lengths, H, Hkv, D, block_size, cap, tau, topk_min); gates with block structure
THRESHOLD_CASES = {
    "ragged-gqa-single-tokens": ([200, 1, 60, 17, 50], 4, 2, 8, 16, 5, 0.8, 0),
    "per-doc-caps-0-and-past-the-blocks": ([240, 130], 2, 1, 8, 16, torch.tensor([0, 20]), 0.5, 2),
    "min-over-cap": ([150], 2, 2, 8, 16, 3, 0.95, 5),
}


def _routes(lens, H, Hkv, D, B, topk, seed=0, q=None, k=None, rule=None):
    """(torch route's plan, fused route's plan, fused launcher calls) of one input, routed
    by ``rule`` (None: top-k)."""
    from sparsebalance.ops import plan as P
    from sparsebalance.ops import route_kernels

    if q is None:
        q, k, _, _, _ = make_inputs(lens, H, Hkv, D, seed=seed)
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32)
    calls = []
    name = "route_rows" if rule is None else "threshold_rows"
    real = getattr(route_kernels, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    plans = []
    for mode in ("torch", "fused"):
        os.environ["SPARSEBALANCE_ROUTE"] = mode
        P._skeletons.clear()
        setattr(route_kernels, name, counted)
        try:
            with P.routing_rule(rule):
                plans.append(P.build_plan(q, k, cu, topk, B, D ** -0.5))
        finally:
            setattr(route_kernels, name, real)
            del os.environ["SPARSEBALANCE_ROUTE"]
    return plans[0], plans[1], len(calls)


if os.environ.get("TRITON_INTERPRET") != "1":
    _interpreter.register(__file__)

    def test_route_kernels_under_interpreter():
        rc, out = _interpreter.run(__file__)
        assert rc == 0, out[-6000:]
        passed = re.search(r"(\d+) passed", out)
        assert passed and int(passed.group(1)) == len(CASES) + 2 * len(THRESHOLD_CASES) + 4, out[-2000:]

    def test_route_switch(monkeypatch):
        """``auto``: fused on CUDA only; ``fused`` / ``torch`` forced; anything else one line."""
        from sparsebalance.ops.plan import fused_route

        monkeypatch.delenv("SPARSEBALANCE_ROUTE", raising=False)
        assert not fused_route(torch.device("cpu"))
        assert fused_route(torch.device("cuda"))  # triton is installed here
        monkeypatch.setenv("SPARSEBALANCE_ROUTE", "torch")
        assert not fused_route(torch.device("cuda"))
        monkeypatch.setenv("SPARSEBALANCE_ROUTE", "fused")
        assert fused_route(torch.device("cpu"))
        monkeypatch.setenv("SPARSEBALANCE_ROUTE", "Fused")
        with pytest.raises(ValueError, match="^SPARSEBALANCE_ROUTE must be one of auto, fused, torch, got 'Fused'$"):
            fused_route(torch.device("cpu"))

    _VIEWS = {"view", "_unsafe_view", "slice", "select", "expand", "unsqueeze", "squeeze", "permute",
              "reshape", "alias", "as_strided", "t", "transpose", "split", "split_with_sizes", "unbind",
              "detach", "lift_fresh", "_reshape_alias"}

    _SYNCS = {"_local_scalar_dense", "nonzero", "item", "masked_select"}
    """Ops that wait for the device on CUDA (a read of a value, a size that depends on
    data), besides a copy to the host."""

    def _layer_counter(monkeypatch):
        """(state, Count mode, per_layer): host work of one layer on the fa4 path with the
        skeleton cached, Triton kernels counted (name, compile-time arguments), not run."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from sparsebalance.ops import route_kernels as rk
        from sparsebalance.ops.fa4 import fa4_prepare
        from sparsebalance.ops.plan import routing_rule

        state = {"ops": 0, "launches": 0, "syncs": [], "keys": set()}

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                if name not in _VIEWS:
                    state["ops"] += 1
                to_host = name == "_to_copy" and (kwargs or {}).get("device") == torch.device("cpu") \
                    and args[0].device.type != "cpu"
                if name in _SYNCS or to_host:
                    state["syncs"].append(name)
                return func(*args, **(kwargs or {}))

        class Stub:  # kernel[grid](...) counted with its compile-time arguments, not run
            def __init__(self, name):
                self.name = name

            def __getitem__(self, grid):
                def launch(*a, **kw):
                    state["launches"] += 1
                    state["keys"].add((self.name, tuple(sorted(kw.items()))))
                return launch

        for name in ("_block_means_kernel", "_route_kernel", "_threshold_kernel", "_bwd_desc_kernel"):
            monkeypatch.setattr(rk, name, Stub(name))

        def per_layer(lens, mode, topk=2, rule=None, device="cpu"):
            """(ops, launches, plan) of a layer's fa4_prepare; ``device="meta"``: q and k
            hold no data, so any read of a device value raises."""
            monkeypatch.setenv("SPARSEBALANCE_ROUTE", mode)
            q, k, _, cu, _ = make_inputs(lens, 16, 2, 8)
            q, k = q.to(device), k.to(device)
            with routing_rule(rule):
                fa4_prepare(q, k, cu, topk, 128, 0.35)  # the micro-batch's first layer builds the skeleton
                state.update(ops=0, launches=0, syncs=[])
                with Count():
                    plan = fa4_prepare(q, k, cu, topk, 128, 0.35)[0]
            return state["ops"], state["launches"], plan

        return state, per_layer

    ONE, MIX = [8192], [1500, 700, 2300, 300, 900, 1200, 800, 492]

    def test_fused_route_launches_per_layer(monkeypatch):
        """Host work per layer on the fa4 path (routing and descriptors, the skeleton cached):
        with the fused route, 4 Triton launches and a few torch ops, whatever the number of
        documents; the torch route issues several dozen ops, more with more documents."""
        state, per_layer = _layer_counter(monkeypatch)
        assert per_layer(ONE, "fused")[:2] == per_layer(MIX, "fused")[:2]
        ops, launches, _ = per_layer(MIX, "fused", torch.tensor([1, 0, 5, 2, 3, 9, 2, 4]))
        assert launches == 4 and ops <= 12 and not state["syncs"], (ops, launches, state["syncs"])
        # micro-batches of one length, other documents and budgets: the same compiled kernels
        assert len(state["keys"]) == 3, state["keys"]
        torch_one, torch_mix = per_layer(ONE, "torch")[0], per_layer(MIX, "torch")[0]
        assert torch_mix > torch_one > 5 * ops, (torch_one, torch_mix, ops)

    @pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
    def test_fused_threshold_route_launches_per_layer_and_never_waits(monkeypatch, per_head):
        """Threshold routing fused: per layer 4 launches per head (5 per block: counts, then
        rows), a few torch ops whatever the documents, and no read of a device value: on the
        meta device (tensors without data) the plan and the descriptors are built, its kept
        pairs stay pending and only reading them fails. The torch route: dozens of ops."""
        from sparsebalance.ops.plan import RoutingRule

        state, per_layer = _layer_counter(monkeypatch)
        rule = RoutingRule(0.8, 1, per_head=per_head)
        budgets = torch.tensor([1, 0, 5, 2, 3, 9, 2, 4])
        ops, launches, plan = per_layer(MIX, "fused", budgets, rule, device="meta")
        assert (ops, launches) == per_layer(ONE, "fused", 4, rule, device="meta")[:2]
        assert launches == 4 + (not per_head) and ops <= 21 + 2 * (not per_head), (ops, launches)
        assert not state["syncs"], state["syncs"]
        assert plan.kept.pending and plan.kv_cnt.device.type == "meta"
        with pytest.raises(NotImplementedError, match="meta"):
            plan.kept_pairs  # the one read: what the step's records do once (read_records)
        assert {key[0] for key in state["keys"]} == {"_block_means_kernel", "_threshold_kernel", "_bwd_desc_kernel"} \
            | (set() if per_head else {"_route_kernel"})
        torch_ops = per_layer(MIX, "torch", budgets, rule)[0]
        assert torch_ops > 4 * ops, (torch_ops, ops)

    def test_first_failed_launch_falls_back_under_auto(monkeypatch):
        """A Triton that cannot compile the kernels: under ``auto`` the first failure warns
        once and routing stays on torch ops (the same plan); forced ``fused``, or a failure
        after a fused launch worked, raises."""
        from sparsebalance.ops import plan as P
        from sparsebalance.ops import route_kernels as rk

        def boom(*a, **kw):
            raise RuntimeError("PTX too new\nmore lines")

        monkeypatch.setattr(P, "_fused_state", {"worked": False, "off": None})
        monkeypatch.setattr(P, "_triton_found", [True])
        monkeypatch.setattr(rk, "route_rows", boom)
        monkeypatch.delenv("SPARSEBALANCE_ROUTE", raising=False)
        q, k, _, cu, _ = make_inputs([400, 300], 2, 1, 8)
        want = P.build_plan(q, k, cu, 2, 16, 0.3)  # CPU: the torch route
        real = P.fused_route
        monkeypatch.setattr(P, "fused_route", lambda dev: real(torch.device("cuda")))  # as on a GPU
        P._skeletons.clear()
        with pytest.warns(UserWarning, match=r"^fused routing failed on its first launch "
                          r"\(RuntimeError: PTX too new\); routing by torch ops"):
            got = P.build_plan(q, k, cu, 2, 16, 0.3)
        assert torch.equal(got.kv_idx, want.kv_idx) and not real(torch.device("cuda"))
        assert P.route_used() == "torch (fused off: RuntimeError: PTX too new)"
        monkeypatch.setattr(P, "_fused_state", {"worked": True, "off": None})
        assert P.route_used() == "fused"
        P._skeletons.clear()
        with pytest.raises(RuntimeError, match="PTX too new"):
            P.build_plan(q, k, cu, 2, 16, 0.3)
        monkeypatch.setattr(P, "_fused_state", {"worked": False, "off": None})
        monkeypatch.setenv("SPARSEBALANCE_ROUTE", "fused")
        with pytest.raises(RuntimeError, match="PTX too new"):
            P.build_plan(q, k, cu, 2, 16, 0.3)

    def test_route_kernels_compile_without_a_gpu(arch=90):
        """Each kernel compiles to a sm_90 cubin (H100 / H200) at the shapes training meets: bf16 inputs, head
        dim 64 and 128, a 512-block document (64K tokens) and the longest one routed; the
        threshold kernel writing rows (per-head counts) and counts only (per-block)."""
        triton = pytest.importorskip("triton")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from sparsebalance.ops import route_kernels as rk
        from sparsebalance.ops.plan import FUSED_MAX_BLOCKS

        i32, p32 = "i32", "*i32"
        route = {"QM": "*fp32", "KM": "*fp32", "KV_IDX": p32, "KV_CNT": p32, "FIRST": p32, "IDX": p32,
                 "H": i32, "REP": i32, "W": i32, "D": i32}
        thr = {"QM": "*fp32", "KM": "*fp32", "KV_IDX": p32, "CAP": p32, "CNT": p32, "FIRST": p32, "IDX": p32,
               "H": i32, "REP": i32, "W": i32, "D": i32, "tau": "fp32", "kmin": i32}
        cases = [
            (rk._block_means_kernel, {"X": "*bf16", "OUT": "*fp32", "QB_START": p32, "QB_LEN": p32,
                                      "s_xt": i32, "s_xh": i32, "scale": "fp32", "NH": i32, "D": i32},
             {"B": 128, "ROWS": 32, "BLOCK_D": 64}),
            (rk._route_kernel, route, {"C_P2": 512, "W_P2": 16, "BLOCK_DC": 16}),
            (rk._route_kernel, route, {"C_P2": FUSED_MAX_BLOCKS, "W_P2": 64, "BLOCK_DC": 1}),
            (rk._threshold_kernel, thr, {"C_P2": 512, "W_P2": 16, "BLOCK_DC": 16, "ROWS": True}),
            (rk._threshold_kernel, thr, {"C_P2": 512, "W_P2": 16, "BLOCK_DC": 16, "ROWS": False}),
            (rk._threshold_kernel, thr, {"C_P2": FUSED_MAX_BLOCKS, "W_P2": 64, "BLOCK_DC": 1, "ROWS": True}),
            (rk._bwd_desc_kernel, {"KV_IDX": p32, "DOC_END": p32, "BWD_CNT": p32, "BWD_IDX": p32, "W": i32},
             {"W_P2": 16, "BLOCK_M": 16}),
        ]
        for fn, sig, ce in cases:
            src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in ce}}, constexprs=ce)
            out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            assert out.asm["cubin"] and out.metadata.shared <= 48 * 1024, (fn.fn.__name__, ce)

else:
    @pytest.mark.parametrize("name", list(CASES))
    def test_fused_route_and_descriptors_equal_torch_ones(name):
        lens, H, Hkv, D, B, topk = CASES[name]
        ref, got, calls = _routes(lens, H, Hkv, D, B, topk)
        assert calls == 1, "the fused route did not run"
        assert torch.equal(got.kv_idx, ref.kv_idx)
        assert torch.equal(got.kv_cnt, ref.kv_cnt) and got.kept_pairs == ref.kept_pairs
        assert torch.equal(got.doc_end, ref.doc_end)
        plan_rows_checked(got)
        fused = fused_descriptors_checked(got)
        assert int(fused.bwd_full_cnt.sum()) == int(fused.fwd_full_cnt.sum()) > 0

    def test_ties_fill_from_the_left():
        """Every key of a document equal: all gates tie, the lowest candidates are kept
        (the torch route's rule); so do zero queries' gates."""
        lens, H, D = [400, 200], 2, 8
        q, k, _, _, _ = make_inputs(lens, H, 1, D, seed=2)
        k = k[:1].expand_as(k).contiguous()
        ref, got, calls = _routes(lens, H, 1, D, 16, 3, q=q, k=k)
        assert calls == 1 and torch.equal(got.kv_idx, ref.kv_idx)
        row = got.kv_idx[0, 20].tolist()  # block 20 of document 0: sink, blocks 1-3, diagonal
        assert row[:5] == [0, 1, 2, 3, 20]
        q0 = torch.zeros_like(q)
        ref, got, _ = _routes(lens, H, 1, D, 16, 3, q=q0, k=-k)
        assert torch.equal(got.kv_idx, ref.kv_idx) and got.kv_idx[1, 24].tolist()[:5] == [0, 1, 2, 3, 24]

    def test_many_rows_one_kernel_per_layer():
        """The whole choice is one route_rows call per layer, with the skeleton cached."""
        from sparsebalance.ops import plan as P
        from sparsebalance.ops import route_kernels

        lens = [200, 100]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        calls = []
        real = route_kernels.route_rows
        route_kernels.route_rows = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        os.environ["SPARSEBALANCE_ROUTE"] = "fused"
        try:
            P._skeletons.clear()
            compiled = []
            for layer in range(3):
                q, k, _, _, _ = make_inputs(lens, 2, 1, 8, seed=layer)
                P.build_plan(q, k, cu, 2, 16, 8 ** -0.5)
                compiled.append(route_kernels.compile_count())
        finally:
            route_kernels.route_rows = real
            del os.environ["SPARSEBALANCE_ROUTE"]
        assert len(calls) == 3 and len(P._skeletons.entries) == 1
        assert compiled[0] >= 2 and compiled == compiled[:1] * 3  # q/k means and the route: no new keys

    def test_a_route_width_hint_compiles_one_gate_for_shorter_micro_batches():
        """Run 7 at 128K compiled after step 2: the gate's width came from each micro-batch's
        length, so a shorter micro-batch (another power of two) compiled again. With the
        driver's hint (--seq-length / block) it is one kernel; the plans stay the torch
        route's."""
        from sparsebalance.ops import plan as P
        from sparsebalance.ops import route_kernels

        batches = [[100, 60], [200, 100], [600]]  # 10, 19 and 38 blocks of 16: widths 16, 32, 64

        def keys_after_each():
            got = []
            for lens in batches:
                before = set(route_kernels._keys)
                ref, plan, _ = _routes(lens, 2, 1, 8, 16, 2)
                assert torch.equal(plan.kv_idx, ref.kv_idx)
                got.append(set(route_kernels._keys) - before)
            return got

        route_kernels._keys.clear()
        assert all(keys_after_each())  # every new width a new kernel
        try:
            P.set_route_width(38)
            route_kernels._keys.clear()
            new = keys_after_each()
        finally:
            P.set_route_width(0)
        assert new[0] and new[1:] == [set(), set()]
        with pytest.raises(ValueError, match="blocks must be an int >= 0"):
            P.set_route_width(-1)

    def _same_plans(ref, got):
        assert torch.equal(got.kv_idx, ref.kv_idx)
        assert torch.equal(got.kv_cnt, ref.kv_cnt) and got.kept_pairs == ref.kept_pairs
        assert (got.doc_kept == ref.doc_kept).all() and (got.head_kept == ref.head_kept).all()
        assert got.kv_nnz == ref.kv_nnz and torch.equal(got.doc_end, ref.doc_end)

    @pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "per-block"])
    @pytest.mark.parametrize("name", list(THRESHOLD_CASES))
    def test_fused_threshold_route_equals_torch_one(name, per_head):
        """Threshold routing fused (counts and rows on the device) equals the torch route's
        plan exactly, and its counts are not all the budget's or the minimum's."""
        from sparsebalance.ops.plan import RoutingRule

        lens, H, Hkv, D, B, cap, tau, kmin = THRESHOLD_CASES[name]
        q, k, _, _, _ = structured_inputs(lens, H, Hkv, D, B)
        ref, got, calls = _routes(lens, H, Hkv, D, B, cap, q=q, k=k, rule=RoutingRule(tau, kmin, per_head=per_head))
        assert calls == 1, "the fused route did not run"
        _same_plans(ref, got)
        plan_rows_checked(got)
        fused_descriptors_checked(got)
        if name != "min-over-cap":  # there the minimum binds every row with a choice
            caps = cap.tolist() if isinstance(cap, torch.Tensor) else [cap] * len(lens)
            budget = torch.tensor([min(i + 1, 2 + c) for L, c in zip(lens, caps) for i in range(-(-L // B))],
                                  dtype=torch.int32)  # the budget's counts: a top-k plan's
            assert bool((got.kv_cnt < budget).any())
            if per_head:
                assert bool((got.kv_cnt != got.kv_cnt[:1]).any())

    def test_threshold_ties_fill_from_the_left():
        """Every key of a document equal: the gates tie, each candidate holds 1/n of the
        softmax, the count is the fewest reaching TAU and the lowest candidates are kept;
        zero queries tie the same way; both per head and per block."""
        from sparsebalance.ops.plan import RoutingRule

        lens, H, D = [336, 40], 2, 8
        q, k, _, _, _ = make_inputs(lens, H, 1, D, seed=2)
        k = k[:1].expand_as(k).contiguous()
        for per_head, qq in ((True, q), (False, torch.zeros_like(q))):
            ref, got, calls = _routes(lens, H, 1, D, 16, 20, q=qq, k=k, rule=RoutingRule(0.3, 0, per_head=per_head))
            assert calls == 1
            _same_plans(ref, got)
            # block 20 of document 0: 19 candidates, the fewest holding 0.3 is 6 (5.7)
            assert got.kv_idx[0, 20].tolist()[:9] == [0, 1, 2, 3, 4, 5, 6, 20, -1]
