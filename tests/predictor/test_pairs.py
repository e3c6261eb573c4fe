"""The predictor counts attention exactly as the kernel does."""

import numpy as np
import pytest

from sparsebalance.pairs import causal_pairs
from sparsebalance.predictor import get_predictor
from sparsebalance.predictor.fitted import layer_features

torch = pytest.importorskip("torch")
try:
    from sparsebalance.ops import sparse_attention
except ImportError as e:  # the kernel package is optional for the predictor
    pytest.skip(f"sparsebalance.ops.sparse_attention is not available: {e}",
                allow_module_level=True)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_pairs_equal_kernel_density_times_causal(seed, block_size):
    g = torch.Generator().manual_seed(seed)
    n_docs = int(torch.randint(1, 5, (1,), generator=g))
    lengths = torch.randint(1, 12 * block_size, (n_docs,), generator=g).tolist()
    topk = int(torch.randint(0, 6, (1,), generator=g))
    T, H, Hkv, D = sum(lengths), 2, 1, 8
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    v = torch.randn(T, Hkv, D, generator=g)
    cu = torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32)
    _, density = sparse_attention(q, k, v, cu, topk=topk, block_size=block_size,
                                  backend="reference", return_density=True)
    causal = int(causal_pairs(lengths).sum())
    ours = layer_features(lengths, topk, block_size)[0]
    # Guard against a vacuous pass: long documents must actually be sparsified.
    if max(lengths) > (topk + 2) * block_size + block_size:
        assert ours < causal
    assert ours == pytest.approx(density * causal, rel=1e-9)


def test_predicted_attention_follows_the_same_counts():
    """A budget changes the prediction only for documents longer than the cap."""
    p = get_predictor("h100-analytic", block_size=64)
    short = np.array([64 * 5])          # 5 blocks: dense at topk >= 3
    long_ = np.array([64 * 200])
    assert p.layer_ms(short, 3, "fwd") == pytest.approx(p.layer_ms(short, None, "fwd"))
    assert p.layer_ms(long_, 3, "fwd") < p.layer_ms(long_, None, "fwd")
