"""Pure helpers the density studies share (``sparsity_study.py`` and its ``--real`` half in
:mod:`benchmarks.harness.sparsity_real`): the corpus's source sidecar and the oracle pair
counts of threshold routing on the true attention."""

from __future__ import annotations

import json

import numpy as np


def read_sidecar(path: str, lengths: np.ndarray, fail) -> list:
    """Source name per document from ``make_hetero_corpus.py``'s sidecar; bad input goes to
    ``fail(message)`` (the script's one-line exit)."""
    try:
        with open(path) as fh:
            side = json.load(fh)
    except OSError as e:
        fail(f"--sources-file: cannot read {path} ({e.strerror}); make the corpus with "
             "benchmarks/make_hetero_corpus.py")
    except ValueError as e:
        fail(f"--sources-file: {path} is not JSON ({e})")
    src = side.get("doc_source") if isinstance(side, dict) else None
    if not isinstance(src, list) or not all(isinstance(s, str) for s in src):
        fail(f"--sources-file: {path} has no 'doc_source' list of source names")
    if len(src) != len(lengths) or list(side.get("lengths", [])) != [int(x) for x in lengths]:
        fail(f"--sources-file: {path} describes {len(src)} documents that do not match the corpus "
             f"({len(lengths)} documents)")
    return src



ORACLES = ("oracle", "per_head", "total_mass")
"""The :func:`oracle_pairs` variants the study reports."""


def oracle_pairs(q, k, scale: float, block: int, tau: float) -> dict:
    """Kept pairs of one document if threshold routing saw the true attention, per variant
    of :data:`ORACLES`, and its ``causal`` pairs (all summed over heads).

    q ``[L, H, D]``, k ``[L, Hkv, D]`` of one document. A query block's mass on a key block
    is the mean over its queries of their dense softmax probabilities summed over the
    block's keys. As the plan does, a query block keeps its sink (block 0) and diagonal
    blocks plus the fewest candidates (the blocks between), one count for every head, with
    no cap or floor here:

    * ``oracle``: the fewest candidates holding ``tau`` of the candidates' mass in every head
      (the plan's rule, on the true mass instead of the block-mean gate's softmax);
    * ``per_head``: the same with each head keeping its own count;
    * ``total_mass``: the fewest candidates that with the sink and diagonal hold ``tau`` of
      all of the query block's mass, in every head (local attention then needs few blocks).

    Pairs are counted as the plan counts them: the diagonal causally, the others whole.
    """
    return oracle_from_mass(block_mass(q, k, scale, block), q.shape[0], block, tau)


def block_mass(q, k, scale: float, block: int):
    """float64 ``[H, query block, key block]``: each query block's dense softmax mass on each
    key block (the sum over its queries of their causal attention probabilities on the
    block's keys), one head at a time (a head's ``[L, L]`` scores at most in memory).
    q ``[L, H, D]``, k ``[L, Hkv, D]`` of one document."""
    import torch

    L, H, _ = q.shape
    nb = -(-L // block)
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    mass = torch.empty(H, nb, nb, dtype=torch.float64)
    for h in range(H):
        s = (q[:, h].float() @ k[:, h // (H // k.shape[1])].float().T) * scale
        s.masked_fill_(future, float("-inf"))
        p = torch.nn.functional.pad(s.softmax(-1), (0, nb * block - L, 0, nb * block - L))
        mass[h] = p.view(nb, block, nb, block).sum(-1).sum(1).double()
    return mass


def oracle_from_mass(mass, L: int, block: int, tau: float) -> dict:
    """:func:`oracle_pairs` of a document of ``L`` tokens from its :func:`block_mass`."""
    import torch

    H, nb = mass.shape[0], mass.shape[1]
    i = torch.arange(nb).view(nb, 1)
    j = torch.arange(nb).view(1, nb)
    is_cand = (j >= 1) & (j < i)  # neither sink nor diagonal
    srt = (mass * is_cand).sort(-1, descending=True).values.cumsum(-1)
    need = (srt < tau * srt[..., -1:] * (1 - 1e-12)).sum(-1) + 1  # [H, nb]
    fixed = (mass * ~is_cand).sum(-1, keepdim=True)  # sink + diagonal
    need_total = (fixed + srt < tau * mass.sum(-1, keepdim=True) * (1 - 1e-12)).sum(-1) + 1
    need_total = torch.where(fixed[..., 0] >= tau * mass.sum(-1) * (1 - 1e-12), 0, need_total)
    ncand = (torch.arange(nb) - 1).clamp(min=0)
    qlen = torch.full((nb,), block, dtype=torch.float64)
    qlen[-1] = L - (nb - 1) * block
    sink = (torch.arange(nb) >= 1).double()

    def pairs(c):  # c: chosen candidates per query block [..., nb]
        return float(((torch.minimum(c, ncand).double() + sink) * qlen * block + qlen * (qlen + 1) / 2).sum())

    return {"oracle": pairs(need.amax(0)) * H, "per_head": pairs(need), "total_mass": pairs(need_total.amax(0)) * H,
            "causal": H * L * (L + 1) / 2}
