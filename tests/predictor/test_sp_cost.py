"""Sequence parallelism in the cost model: the padding each micro-batch is stored with
(``sparsebalance.cp_split.sequence_parallel_pad``, what the driver pads) costs linear time
in every layer and in the extras, and the DST planner's op tables count it."""

import numpy as np
import pytest

from sparsebalance.cp_split import padded_lengths, sequence_parallel_pad
from sparsebalance.predictor import get_predictor

SHAPE = dict(num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=2,
             ffn_hidden_size=2048, vocab_size=32000, block_size=64, topk=4)
ODD = np.array([1001, 64, 77])  # 1142 tokens; 1142 % 4 == 2


@pytest.mark.parametrize("tokens,cp,sp,pad", [(7, 1, 2, 1), (8, 1, 2, 0), (9, 1, 4, 3), (1, 1, 8, 7),
                                              (12, 2, 2, 0), (4, 2, 3, 8), (8, 2, 4, 0), (4, 2, 4, 4), (6, 3, 2, 0),
                                              (6, 3, 4, 6)])
def test_sequence_parallel_pad(tokens, cp, sp, pad):
    got = sequence_parallel_pad(tokens, cp, sp)
    assert got == pad
    assert ((tokens + got) // cp) % sp == 0 and (cp == 1 or got % (2 * cp) == 0)
    assert sequence_parallel_pad(tokens, cp, 1) == 0
    if cp > 1:
        with pytest.raises(ValueError, match="multiple of 2 \\* cp"):
            sequence_parallel_pad(tokens + 1, cp, sp)


def _pair(sp, cp=1):
    kw = dict(SHAPE, context_parallel_size=cp)
    return get_predictor("h100-analytic", **kw), get_predictor("h100-analytic", **kw, sequence_parallel_size=sp)


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("phase", ["fwd", "bwd"])
def test_padding_costs_linear_time_in_layers_and_extras(cp, phase):
    base, sp = _pair(4, cp)
    stored = int(padded_lengths(ODD, cp).sum()) if cp > 1 else int(ODD.sum())
    pad = sequence_parallel_pad(stored, cp, 4)
    assert sp.pad_tokens(ODD) == pad > 0 and base.pad_tokens(ODD) == 0
    # per-document terms (what the packers add up) do not change
    np.testing.assert_array_equal(sp.layer_doc_ms(ODD, 4, phase), base.layer_doc_ms(ODD, 4, phase))
    token_ms = base._linear_ms(4, phase)[0]
    per_token = token_ms if cp == 1 else token_ms / cp + base._exchange_ms_per_token(phase)
    assert sp.layer_ms(ODD, 4, phase) - base.layer_ms(ODD, 4, phase) == pytest.approx(per_token * pad, rel=1e-9)
    tokens = int(ODD.sum())
    extra = base._extras_ms((tokens + pad) / cp, 1, 2, phase) - base._extras_ms(tokens / cp, 1, 2, phase)
    assert sp.extras_ms(ODD, 1, 2, phase) - base.extras_ms(ODD, 1, 2, phase) == pytest.approx(extra, rel=1e-9)
    assert extra > 0
    # a micro-batch that splits evenly needs no padding and costs the same
    even = np.array([1000, 24])
    assert sp.pad_tokens(even) == 0 and sp.stage_ms(even, 4, 1, 2, phase) == base.stage_ms(even, 4, 1, 2, phase)


def test_planner_tables_price_the_padding_like_stage_ms():
    """DST's op tables (``from_predictor.op_ms_tables``) equal the predictor's stage_ms,
    padding included, and the packers' extras probe is still exact (no padding there)."""
    from sparsebalance.batching.cost import CostModel
    from sparsebalance.tuning.from_predictor import op_ms_tables

    base, sp = _pair(2)
    lengths = [[[1001, 64], [77]], [[3, 4, 5], [256]]]  # odd, odd, even, even
    fwd, bwd = op_ms_tables(sp, lengths, [2, 4], 2)
    for li, k in enumerate((2, 4)):
        for d in range(2):
            for m in range(2):
                for s in range(2):
                    for tab, ph in ((fwd, "fwd"), (bwd, "bwd")):
                        assert tab[li, d, m, s] == pytest.approx(sp.stage_ms(lengths[d][m], k, s, 2, ph), rel=1e-12)
    base_fwd, _ = op_ms_tables(base, lengths, [2, 4], 2)
    assert (fwd[:, 0] > base_fwd[:, 0]).all() and (fwd[:, 1] == base_fwd[:, 1]).all()  # [level, dp, M, stage]
    for a, b in ((CostModel(sp, topk=4, pp=2), CostModel(base, topk=4, pp=2)),):
        np.testing.assert_allclose(a.extra_b, b.extra_b, rtol=1e-9)
        np.testing.assert_allclose(a.extra_a, b.extra_a, rtol=1e-9, atol=1e-12)


def test_driver_builds_the_sp_predictor():
    """pretrain_gpt.py's --sequence-parallel with TP reaches the predictor (sb_config.py)."""
    from megatron.training.arguments import build_parser
    from megatron.training.sb_config import build_predictor, parallel_config

    args = build_parser().parse_args(["--sb-cost-model", "h100-analytic", "--sparse-attention",
                                      "--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert parallel_config(args).sp == 2 and build_predictor(args, vocab_size=256).sequence_parallel == 2
    args.sequence_parallel = False
    assert parallel_config(args).sp == 1 and build_predictor(args, vocab_size=256).sequence_parallel == 1
    with pytest.raises(ValueError, match=">= 1"):
        get_predictor("h100-analytic", sequence_parallel_size=0)
