"""Decode-time sparse attention and chat samples of the real-model retrieval
(benchmarks/harness/longctx/real.py); pairing pieces of benchmarks/harness/compare/real_arms.py."""

import numpy as np
import pytest
import torch

from benchmarks.harness.compare.real_arms import Arm, arm_pairs, bracket, paired_interval, stage_of, topk_pairs
from benchmarks.harness.longctx.real import answer_correct, chat_sample, decode_attention, split_prompt
from benchmarks.harness.longctx.tasks import generate
from sparsebalance.ops import sparse_attention


def _qkv(T, H=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g) for h in (H, Hkv, Hkv)]


def _dense_rows(q, k, v, start, scale):
    H = q.shape[1]
    kh, vh = (x.repeat_interleave(H // k.shape[1], 1) for x in (k, v))
    out = []
    for a in range(q.shape[0]):
        t = start + a
        p = torch.softmax(torch.einsum("hd,thd->ht", q[a], kh[:t + 1]) * scale, 1)
        out.append(torch.einsum("ht,thd->hd", p, vh[:t + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("topk", [None, 50])
def test_decode_dense_when_budget_covers_every_block(topk):
    q, k, v = _qkv(70)
    got = decode_attention(q[60:], k, v, 60, topk=topk, block_size=8, scale=0.3)
    torch.testing.assert_close(got, _dense_rows(q[60:], k, v, 60, 0.3))


def test_decode_token_routes_like_a_query_block_of_one():
    """A decode token's output equals the library's reference routing for a document that
    ends at that token whose last query block is the token alone (block 1 queries)."""
    B, T, k = 8, 8 * 9 + 1, 3  # the last token opens block 9: a query block of one token
    q, k_, v = _qkv(T, seed=3)
    got = decode_attention(q[T - 1:], k_, v, T - 1, topk=k, block_size=B, scale=0.25)
    ref = sparse_attention(q, k_, v, torch.tensor([0, T], dtype=torch.int32), topk=k, block_size=B,
                           softmax_scale=0.25, backend="reference")[T - 1:]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_chat_sample_puts_the_answer_prefix_in_the_assistant_turn():
    s = generate("niah_single", 1024, 0, 0)
    user, prefix = split_prompt(s.prompt)
    assert prefix.startswith("The special magic number for") and prefix.endswith(":")
    prompt, answer = chat_sample(s, lambda u: f"<user>{u}</user>\n")
    assert prompt.endswith("</user>\n" + prefix) and answer == " " + s.answer
    vt = generate("variable_tracking", 1024, 0, 0)
    assert split_prompt(vt.prompt)[1] == "Answer:"


def test_answer_correct_needs_the_answer_then_a_stop():
    dec = {1: "1", 2: "2", 3: ".", 4: "7"}
    assert answer_correct(torch.tensor([1, 2, 3]), torch.tensor([1, 2]), lambda ids: dec[ids[0]])
    assert not answer_correct(torch.tensor([1, 2, 4]), torch.tensor([1, 2]), lambda ids: dec[ids[0]])
    assert not answer_correct(torch.tensor([1, 1, 3]), torch.tensor([1, 2]), lambda ids: dec[ids[0]])


def test_stage_of_splits_uneven_layers_in_order():
    assert [stage_of(layer, 30, 4) for layer in range(1, 31)] == [0] * 8 + [1] * 8 + [2] * 7 + [3] * 7
    assert [stage_of(layer, 8, 8) for layer in range(1, 9)] == list(range(8))


def test_bracket_interpolates_between_static_budgets():
    lens = [[700, 300], [1000]]
    sb = Arm("sb", stage_budgets=np.array([[9, 6], [8, 10]]))
    target = arm_pairs(sb, lens, 64, 4, 2)
    lo, hi, w = bracket(target, lambda k: arm_pairs(Arm("s", topk=k), lens, 64, 4, 2))
    p = [arm_pairs(Arm("s", topk=x), lens, 64, 4, 2) for x in (lo, hi)]
    assert p[0] <= target <= p[1] and (1 - w) * p[0] + w * p[1] == pytest.approx(target)
    assert topk_pairs([10], None, 64) == 55


def test_paired_interval_covers_a_constant_shift():
    r = paired_interval(np.full(6, 0.02), np.arange(1, 7))
    assert r["interval"] == pytest.approx([0.02] * 3) and r["mean"] == pytest.approx(0.02)


def test_eval_longctx_real_model_hands_its_flags_to_real_accuracy():
    from benchmarks.eval_longctx import build_parser, real_model_argv

    a = build_parser().parse_args(["--load", "m", "--real-model", "--lengths", "2048,4096", "--num-samples", "3",
                                   "--sb-topk", "6", "--json"])
    argv = real_model_argv(a)
    assert argv[:4] == ["--load", "m", "--num-microbatches", "0"] and argv[-1] == "--json"
    assert argv[argv.index("--tasks") + 1] == "niah_single,niah_multikey,variable_tracking"
    assert argv[argv.index("--topk") + 1] == "6" and "--block-size" not in argv
