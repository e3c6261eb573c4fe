"""torchrun worker for tests/attention/test_cp_attention.py.

Every rank builds the same random ``q, k, v`` of a packed micro-batch, keeps its CP
share (sparsebalance.attention.context_parallel), runs dense and sparse attention of
its queries against the gathered keys, back-propagates a fixed weighted sum, and
writes ``$SB_TEST_DUMP/rank<r>.npz``: outputs and dq/dk/dv scattered to compact
(real-token) positions, plus the kept pairs it counted. Rank 0 also writes the CP=1
results of the same inputs (``ref.npz``). A test-only env var, not a flag.

Then the attention modules (dense, and sparse on the cpu backend) run a micro-batch of
one 1-token document, whose CP share on rank 1 is padding only: both ranks must finish
forward and backward (the K/V gather's backward is a collective: without rank 1 in it,
both ranks wait until the test's timeout) and rank 0 writes what its real query got
(``padonly.npz``).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LENGTHS = [100, 37, 250, 6, 1]
H, HKV, D, B, TOPK = 4, 2, 16, 16, 2


def main() -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from sparsebalance.attention import context_parallel as C
    from sparsebalance.attention.dense import causal_local_attention, causal_varlen_attention
    from sparsebalance.cp_split import padded_lengths
    from sparsebalance.ops import sparse_attention

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(cp)))
    g = torch.Generator().manual_seed(3)
    T = sum(LENGTHS)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, HKV, HKV))
    w = torch.randn(T, H, D, generator=g)  # loss weights
    P = padded_lengths(LENGTHS, cp)
    lay = C.build_layout(LENGTHS, P, cp, rank)
    # local tensors: real rows from the full ones, padding rows random (must not matter)
    def local(x):
        out = torch.randn((lay.t_local,) + tuple(x.shape[1:]), generator=g)
        out[lay.local_rows] = x[lay.local_pos]
        return out.requires_grad_()

    dump = os.environ["SB_TEST_DUMP"]
    res = {}
    scale = 1.0 / D ** 0.5
    for name in ("dense", "cpu", "reference"):
        ql, kl, vl = local(q), local(k), local(v)
        kf, vf = C.gather_kv(kl, vl, lay, group)
        qr = ql.index_select(0, lay.local_rows)
        if name == "dense":
            o, kept = causal_local_attention(qr, kf, vf, lay), lay.causal_pairs * H
        else:
            o, kept = C.sparse_attention_local(qr, ql, kf, vf, lay, group, topk=TOPK, block_size=B,
                                               scale=scale, backend=name)
        (o * w[lay.local_pos]).sum().backward()
        pos = lay.local_pos.numpy()
        rows = lay.local_rows
        res[f"{name}/pos"] = pos
        res[f"{name}/out"] = o.detach().numpy()
        for gname, t in (("dq", ql), ("dk", kl), ("dv", vl)):
            res[f"{name}/{gname}"] = t.grad[rows].numpy()
        res[f"{name}/kept"] = np.array(kept)
        # padding rows get no gradient
        pad = torch.ones(lay.t_local, dtype=torch.bool)
        pad[rows] = False
        res[f"{name}/pad_grad"] = np.array(float(sum(t.grad[pad].abs().sum() for t in (ql, kl, vl))))
    os.makedirs(dump, exist_ok=True)
    np.savez(os.path.join(dump, f"rank{rank}.npz"), **res)
    if rank == 0:
        ref = {}
        cu = torch.tensor(np.concatenate([[0], np.cumsum(LENGTHS)]), dtype=torch.int32)
        for name in ("dense", "cpu", "reference"):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            if name == "dense":
                o, kept = causal_varlen_attention(qq, kk, vv, cu), None
            else:
                o, dens = sparse_attention(qq, kk, vv, cu, topk=TOPK, block_size=B, backend=name,
                                           return_density=True)
                lens = np.asarray(LENGTHS)
                kept = round(dens * int((lens * (lens + 1) // 2).sum()) * H)
            (o * w).sum().backward()
            ref[f"{name}/out"] = o.detach().numpy()
            for gname, t in (("dq", qq), ("dk", kk), ("dv", vv)):
                ref[f"{name}/{gname}"] = t.grad.numpy()
            ref[f"{name}/kept"] = np.array(-1 if kept is None else kept)
        np.savez(os.path.join(dump, "ref.npz"), **ref)
    padding_only_share(group, dump)
    dist.barrier()
    dist.destroy_process_group()


def padding_only_share(group, dump: str) -> None:
    """A 1-token document through the modules' CP path: rank 1 holds only padding."""
    import types

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from sparsebalance.attention import context_parallel as C
    from sparsebalance.attention.dense import CausalVarlenAttention
    from sparsebalance.attention.packed import BudgetedPackedSeqParams
    from sparsebalance.attention.sparse import SparseAttention
    from sparsebalance.cp_split import padded_lengths

    cp, rank = dist.get_world_size(), dist.get_rank()
    lengths = [1]
    lay = C.build_layout(lengths, padded_lengths(lengths, cp), cp, rank)
    assert (len(lay.local_rows) == 0) == (rank == 1), lay.local_rows
    config = TransformerConfig(num_layers=1, hidden_size=H * D, num_attention_heads=H, num_query_groups=HKV,
                               context_parallel_size=cp, use_cpu_initialization=True,
                               attention_dropout=0.0)  # the sparse module applies none (the dense one too here)
    pgs = types.SimpleNamespace(cp=group)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    params = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cp_layout=lay)
    modules = {"dense": CausalVarlenAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs),
               "sparse": SparseAttention(config, 1, AttnMaskType.causal, "self", pg_collection=pgs,
                                         block_size=B, topk=TOPK, backend="cpu")}
    g = torch.Generator().manual_seed(5)
    res = {}
    for name, module in modules.items():
        q, k, v = (torch.randn(lay.t_local, h, D, generator=g).requires_grad_() for h in (H, HKV, HKV))
        out = module(q, k, v, None, packed_seq_params=params)
        out.sum().backward()  # would wait forever on one rank without the gather's backward
        if rank == 0:
            row = int(lay.local_rows[0])
            res[f"{name}/out"] = out.detach().reshape(lay.t_local, H, D)[row].numpy()
            res[f"{name}/v"] = v.detach()[row].numpy()
            res[f"{name}/dv"] = v.grad[row].numpy()
    if rank == 0:
        np.savez(os.path.join(dump, "padonly.npz"), **res)


if __name__ == "__main__":
    main()
