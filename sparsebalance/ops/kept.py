"""A routing plan's kept (query, key) pairs, known on the host or still on the device.

Top-k routing knows its kept pairs when the plan is built (they follow the documents and
budgets). Threshold routing chooses its counts on the device, and reading them back right
away would make every layer wait for its gates, a host sync per layer. So a threshold
plan holds them as one int64 device tensor, read to the host when first used;
:func:`read_kept` reads many at once (the attention records of a step: one copy).
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch


class KeptPairs:
    """Kept pairs per document (over heads) and per head (over documents), and the valid
    ``kv_idx`` entries of the plan's widest head.

    Args:
        doc: int64 ``[n_docs]`` (None: not known per document).
        head: int64 ``[H]`` (None: not known per head).
        nnz: valid entries of the widest head's rows.
        total: kept pairs over documents and heads (default ``doc.sum()``).
        device: instead of the above, int64 ``[n_docs + 2 * H]`` on the device: per
            document, per head, then each head's valid entries; read on first use.
    """

    def __init__(self, doc: Optional[np.ndarray] = None, head: Optional[np.ndarray] = None,
                 nnz: Optional[int] = None, total: Optional[int] = None,
                 device: Optional[torch.Tensor] = None, n_docs: int = 0):
        self._device, self._n_docs = device, n_docs
        self._doc, self._head, self._nnz = doc, head, nnz
        self._total = int(doc.sum()) if total is None and doc is not None else total

    @property
    def pending(self) -> bool:
        """Still on the device (nothing read yet)."""
        return self._device is not None

    def _fill(self, host: np.ndarray) -> None:
        n = self._n_docs
        H = (len(host) - n) // 2
        self._doc, self._head = host[:n], host[n:n + H]
        self._nnz, self._total = int(host[n + H:].max()) if H else 0, int(self._doc.sum())
        self._device = None

    def _read(self) -> "KeptPairs":
        if self._device is not None:
            read_kept([self])
        return self

    @property
    def total(self) -> int:
        """Kept pairs over documents and heads."""
        return self._read()._total

    @property
    def doc(self) -> Optional[np.ndarray]:
        return self._read()._doc

    @property
    def head(self) -> Optional[np.ndarray]:
        return self._read()._head

    @property
    def nnz(self) -> Optional[int]:
        return self._read()._nnz


def read_kept(items: Iterable[Optional[KeptPairs]]) -> int:
    """Read every pending one of ``items`` to the host in one device-to-host copy (None
    entries and ones read before are skipped). Returns the copies made (0 or 1)."""
    pend = list({id(x): x for x in items if x is not None and x.pending}.values())
    if not pend:
        return 0
    host = torch.cat([x._device for x in pend]).cpu().numpy()
    for x, part in zip(pend, np.split(host, np.cumsum([x._device.numel() for x in pend])[:-1])):
        x._fill(part)
    return 1
