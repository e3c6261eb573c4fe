"""sparsebalance/eval/attention_probe.py (where heads read while writing a needle's value);
tools/needle_attention.py's bad input is in tests/integration/test_bad_input.py, its run
on a trained checkpoint in test_longctx_recipe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsebalance.eval.attention_probe import FAR, NeedleAttention, attention_rows, needle_value_start
from sparsebalance.eval.tasks import TaskConfig, generate


@pytest.mark.parametrize("hkv", [4, 2])
def test_attention_rows_reproduce_causal_attention(hkv):
    g = torch.Generator().manual_seed(3)
    T, H, D = 23, 4, 8
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, hkv, hkv))
    rows = [0, 6, 22]
    probs = attention_rows(q, k, rows, scale=0.3)
    assert probs.shape == (3, H, T)
    assert torch.allclose(probs.sum(-1), torch.ones(3, H))
    assert float(probs[1, :, 7:].abs().max()) == 0.0 and float(probs[0, :, 1:].abs().max()) == 0.0
    # Weighting the values by these rows gives torch's causal attention output there.
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=0.3,
                                         enable_gqa=hkv != H)[0].transpose(0, 1)
    mine = torch.einsum("rht,thd->rhd", probs, v.repeat_interleave(H // hkv, dim=1))
    assert torch.allclose(mine, ref[rows], atol=1e-5)


def test_attention_rows_bad_shapes():
    with pytest.raises(ValueError, match="do not match"):
        attention_rows(torch.zeros(5, 3, 4), torch.zeros(5, 2, 4), [1])
    with pytest.raises(ValueError, match="rows must be"):
        attention_rows(torch.zeros(5, 2, 4), torch.zeros(5, 2, 4), [5])


def test_needle_value_start_points_at_the_value():
    for n, digits in ((1024, 7), (2048, 24)):
        s = generate("niah_single", n, 86, 3, config=TaskConfig(value_digits=digits))
        v0 = needle_value_start(s)
        assert s.prompt[v0:v0 + digits] == s.answer and s.prompt[v0 - 4:v0] == "is: "
    with pytest.raises(ValueError, match="niah_single"):
        needle_value_start(generate("niah_multikey", 1024, 86, 0))


def _one_hot(T, H, where):
    """[digits, H, T] probabilities with all mass of head h, row j at where[h][j]."""
    p = torch.zeros(len(where[0]), H, T)
    for h in range(H):
        for j, t in enumerate(where[h]):
            p[j, h, t] = 1.0
    return p


def test_needle_attention_separates_copying_and_slipping_heads():
    # Two samples, 4 digits each, value at 100 and 300. Head 0 reads every digit it
    # writes (content copy); head 1 reads 47 past it but slips once (+48), and that
    # digit is the one the model got wrong; head 2 reads far away.
    acc = NeedleAttention(window=64)
    for v0, slip, right in ((100, None, [True] * 4), (300, 2, [True, True, False, True])):
        where = [[v0 + j for j in range(4)],
                 [v0 + j + (48 if j == slip else 47) for j in range(4)],
                 [5] * 4]
        acc.add({1: _one_hot(400, 3, where)}, v0, right)
    s = acc.summary()
    assert s["digit_accuracy"] == 7 / 8 and s["position_accuracy"] == [1.0, 1.0, 0.5, 1.0]
    copy, slip, far = s["heads"]
    assert (copy["layer"], copy["head"]) == (1, 0) and copy["on_target"] == 1.0 and copy["value_mass"] == 1.0
    assert copy["mode_offset"] == 0 and copy["at_mode"] == 1.0 and copy["acc_off_mode"] is None
    assert slip["on_target"] == 0.0 and slip["value_mass"] == 0.0
    assert slip["mode_offset"] == 47 and slip["at_mode"] == 7 / 8
    assert slip["acc_at_mode"] == 1.0 and slip["acc_off_mode"] == 0.0
    assert slip["offsets"] == [[47, 7 / 8], [48, 1 / 8]]
    assert far["mode_offset"] is None and far["offsets"] == [[FAR, 1.0]] and far["acc_off_mode"] == 7 / 8


def test_needle_attention_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="rows for 3 scored digits"):
        NeedleAttention().add({2: torch.zeros(4, 1, 10)}, 0, [True] * 3)
    with pytest.raises(ValueError, match="window"):
        NeedleAttention(window=-1)
