"""Context parallelism in the cost model: per-rank pairs, per-rank time, exchange term,
and the packers / planners built on it."""

import numpy as np
import pytest
import torch
from test_predictor_interface import COEF

from sparsebalance.config import ModelShape
from sparsebalance.pairs import kept_pairs
from sparsebalance.predictor import LINKS, ContextParallel, get_predictor
from sparsebalance.predictor.context_parallel import GLOO_CPU, NVLINK, rank_kept_pairs
from sparsebalance.predictor.fitted import FittedPredictor

SHAPE = dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=2,
             ffn_hidden_size=2048, vocab_size=32000, block_size=64, topk=4)


@pytest.mark.parametrize("topk", [None, 0, 2, 32])
@pytest.mark.parametrize("block", [1, 16, 64])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_pairs_add_up_to_the_documents_pairs(topk, block, cp):
    rng = np.random.default_rng(cp * 100 + block)
    L = np.concatenate([rng.integers(1, 6000, 200), [1, 2, block - 1, block, block + 1, 2 * cp]])
    L = L[L > 0]
    per_rank = rank_kept_pairs(L, topk, block, cp)
    assert per_rank.shape == (len(L), cp) and (per_rank >= 0).all()
    np.testing.assert_array_equal(per_rank.sum(axis=1), kept_pairs(L, topk, block))


@pytest.mark.parametrize("length,topk", [(300, 2), (257, 1), (96, None), (500, 0)])
def test_rank_pairs_match_the_routing_mask_and_the_drivers_split(length, topk):
    """Kept pairs of each CP rank's real queries, counted from the reference routing mask
    (``ops.reference._doc_mask``) and the token split the driver trains with
    (``sparsebalance.cp_split.local_token_index``)."""
    from sparsebalance.cp_split import local_token_index, padded_lengths
    from sparsebalance.ops.reference import _doc_mask

    B, cp = 16, 2
    torch.manual_seed(0)
    q, k = torch.randn(length, 2, 8), torch.randn(length, 2, 8)
    per_query = _doc_mask(q, k, length if topk is None else topk, B, B, 0.1)[0].sum(dim=1).numpy()
    P = padded_lengths([length], cp)
    got = rank_kept_pairs([length], topk, B, cp)[0]
    for r in range(cp):
        rows = local_token_index(P, cp, r)
        assert got[r] == per_query[rows[rows < length]].sum()


def test_head_tail_balances_dense_but_not_capped_documents():
    """Dense causal work splits evenly; under a top-k cap the middle chunks (all at the
    cap) cost more than the head chunk + tail chunk pair, so the slowest rank is above
    the mean, and the model charges the slowest rank."""
    dense = rank_kept_pairs([32768], None, 256, 2)[0]
    assert abs(dense[0] - dense[1]) / dense.mean() < 1e-3
    capped = rank_kept_pairs([32768], 32, 256, 2)[0]
    assert capped[1] > capped[0] and capped.max() / capped.mean() > 1.1


def _pair(cp_size, link=NVLINK, **shape):
    base = get_predictor("h100-analytic", **{**SHAPE, **shape})
    cp = get_predictor("h100-analytic", **{**SHAPE, **shape}, context_parallel_size=cp_size,
                       context_parallel_link=link)
    return base, cp


@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_cp2_is_half_the_compute_plus_the_exchange(phase):
    base, cp = _pair(2)
    L = np.array([8192, 4096, 1024, 132, 64])  # multiples of 2 x CP: no padding
    s = cp.shape
    exchange = (2 * s.num_query_groups * s.head_dim * 2 * (2 - 1) / 2  # bytes per token
                / (360.0 * 1e6)) * L * (1.0 if phase == "fwd" else NVLINK.bwd_factor)
    slow = rank_kept_pairs(L, 4, 64, 2).max(axis=1)
    token_ms = base._linear_ms(4, phase)[0]
    expect = base.pair_ms(4, phase) * slow + token_ms * L / 2 + exchange
    np.testing.assert_allclose(cp.layer_doc_ms(L, 4, phase), expect, rtol=1e-12)
    # the compute is about half (the slowest rank holds a bit more than half the pairs)
    compute = (cp.layer_doc_ms(L, 4, phase) - exchange).sum() / base.layer_doc_ms(L, 4, phase).sum()
    assert 0.5 < compute < 0.52
    assert cp.layer_const_ms(phase) == pytest.approx(base.layer_const_ms(phase) + NVLINK.latency_ms)
    for stage in (0, 1):
        assert cp.extras_ms(L, stage, 2, phase) == pytest.approx(base.extras_ms(L, stage, 2, phase) / 2)


def test_dense_documents_split_exactly_and_exchange_scales_with_link():
    base, cp = _pair(2)
    L = np.array([4096])
    for phase in ("fwd", "bwd"):
        compute = base.layer_doc_ms(L, None, phase)[0] / 2
        nv = cp.layer_doc_ms(L, None, phase)[0]
        gloo = _pair(2, GLOO_CPU)[1].layer_doc_ms(L, None, phase)[0]
        per_token = cp.context_parallel.exchange_bytes_per_token(2, 64)  # 2 x 2 x 64 x 2 B x 1/2
        assert per_token == 256.0
        factor = 1.0 if phase == "fwd" else NVLINK.bwd_factor
        assert nv - compute == pytest.approx(per_token * 4096 / NVLINK.bytes_per_ms * factor, rel=1e-9)
        # gloo is 360x slower and all-reduces in the backward (2x the bytes)
        ratio = (gloo - compute) / (nv - compute)
        assert ratio == pytest.approx(360.0 * (2.0 if phase == "bwd" else 1.0), rel=1e-2)


def test_cp_pads_documents_like_the_driver():
    """A 1-token document under CP=4 is stored as 8 tokens (2 per rank): the linear work
    and the exchange count the padding, the attention only the real query."""
    _, cp = _pair(4)
    token = cp._linear_ms(4, "fwd")[0]
    ex = cp.context_parallel.exchange_bytes_per_token(2, 64) / NVLINK.bytes_per_ms
    expect = cp._pair_ms(None, "fwd") * 1 + token * 8 / 4 + ex * 8
    assert cp.layer_doc_ms([1], None, "fwd")[0] == pytest.approx(expect, rel=1e-12)


def test_cp1_changes_nothing_and_bad_input():
    base, cp1 = _pair(1)
    L = np.array([5000, 77])
    assert (base.layer_doc_ms(L, 4, "bwd") == cp1.layer_doc_ms(L, 4, "bwd")).all()
    with pytest.raises(ValueError, match="context_parallel_link"):
        get_predictor("h100-analytic", context_parallel_size=2, context_parallel_link="carrier-pigeon")
    with pytest.raises(ValueError, match=">= 1"):
        get_predictor("h100-analytic", context_parallel_size=0)
    assert set(LINKS) == {"nvlink", "gloo-cpu"}


def test_fitted_profile_keeps_per_document_overheads_whole():
    shape = ModelShape(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=4,
                       block_size=64)
    pred = FittedPredictor(shape, COEF)
    pred.set_context_parallel(ContextParallel(2, GLOO_CPU, dtype_bytes=4))
    L = np.array([1024])
    token, doc = FittedPredictor(shape, COEF)._linear_ms(8, "fwd")
    assert doc == COEF["layer"]["fwd"]["docs"] and token == COEF["layer"]["fwd"]["tokens"]
    ex = 2 * 4 * 32 * 4 * 0.5 / GLOO_CPU.bytes_per_ms
    expect = (COEF["layer"]["fwd"]["pairs"] * rank_kept_pairs(L, 8, 64, 2).max()
              + token * 512 + doc + ex * 1024)
    assert pred.layer_doc_ms(L, 8, "fwd")[0] == pytest.approx(expect, rel=1e-12)


def test_packing_and_budgets_under_cp():
    """SAB's cost model and DST's instance read the CP predictor: the packer's own
    prediction equals the planner's instance, each op is about half the CP=1 one, and
    the plan still cuts the step."""
    from sparsebalance.batching import PackingSampler
    from sparsebalance.tuning import critical_path_plan
    from sparsebalance.tuning.from_predictor import build_instance

    rng = np.random.default_rng(1)
    docs = rng.choice([1000, 3000, 8000, 20000, 30000], size=300, p=[0.4, 0.25, 0.15, 0.1, 0.1])
    # the predictor's default shape (Qwen2.5-0.5B-like, block 256, top-32)
    base = get_predictor("h100-analytic")
    cp = get_predictor("h100-analytic", context_parallel_size=2)
    steps = {}
    for name, pred in (("cp1", base), ("cp2", cp)):
        sampler = PackingSampler(docs, dp=2, micro_batches=4, seq_length=32768, strategy="sab",
                                 seed=0, predictor=pred, pp=2)
        plan = sampler.next_step()
        lengths = [[[int(s[2]) for s in mb] for mb in r] for r in plan.ranks]
        inst = build_instance(pred, lengths, pp=2, k0=32)
        k0 = np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index)
        from sparsebalance.tuning.plan import timeline_at

        static = timeline_at(inst, k0).step_ms
        assert static == pytest.approx(plan.step_ms, rel=1e-9)  # packer and planner agree
        cut = critical_path_plan(inst, eps=0.0)
        assert cut.step_ms <= static + 1e-9
        steps[name] = (lengths, inst, static)
    # the same packing under both models: every op at every budget is cheaper under CP=2,
    # but more than half (per-layer constants and the exchange are not split)
    inst1 = build_instance(base, steps["cp2"][0], pp=2, k0=32)
    inst2 = steps["cp2"][1]
    for tab in ("fwd", "bwd"):
        ratio = getattr(inst2, tab) / getattr(inst1, tab)
        assert (ratio > 0.5).all() and (ratio < 1.0).all()
    # retained attention is a property of the model, not of the split
    np.testing.assert_array_equal(inst1.attn, inst2.attn)


def test_driver_builds_the_cp_predictor():
    """pretrain_gpt.py's --context-parallel-size reaches the predictor (sb_config.py)."""
    from megatron.training.arguments import build_parser
    from megatron.training.sb_config import build_predictor

    args = build_parser().parse_args(["--sb-cost-model", "h100-analytic", "--sparse-attention"])
    args.context_parallel_size = 2
    pred = build_predictor(args, vocab_size=256)
    assert pred.context_parallel.size == 2 and pred.context_parallel.link is NVLINK
    args.context_parallel_size = 1
    assert build_predictor(args, vocab_size=256).context_parallel.size == 1


@pytest.mark.parametrize("pred", [get_predictor("h100-analytic", **SHAPE),
                                  FittedPredictor(ModelShape(num_layers=4, hidden_size=128,
                                                             num_attention_heads=4, num_query_groups=4,
                                                             block_size=64), COEF)],
                         ids=["analytic", "fitted"])
@pytest.mark.parametrize("topk", [None, 0, 4])
def test_linear_terms_decompose_the_layer_model(pred, topk):
    """What CP splits (``_linear_ms``) is exactly the non-attention part of the CP=1 model."""
    L = np.array([1, 63, 64, 1000, 7777])
    for phase in ("fwd", "bwd"):
        token_ms, doc_ms = pred._linear_ms(topk, phase)
        expect = pred._pair_ms(topk, phase) * kept_pairs(L, topk, pred.block_size) + token_ms * L + doc_ms
        np.testing.assert_allclose(pred.layer_doc_ms(L, topk, phase), expect, rtol=1e-12)
