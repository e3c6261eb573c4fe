"""Optional compiled extensions, imported once; the package works without them."""

from __future__ import annotations

import logging

_log = logging.getLogger("sparsebalance.ops")

try:
    from sparsebalance import _C as cpu_ext  # built by setup.py / `make build`

    HAS_CPU_EXT = True
except ImportError as exc:  # not built (fresh clone) or built for another torch
    cpu_ext = None
    HAS_CPU_EXT = False
    _log.warning("sparsebalance._C not available (%s); the 'cpu' backend is disabled, "
                 "run `make build`. Falling back to the reference backend.", exc)

try:
    from sparsebalance import _C_cuda as cuda_ext  # only built where CUDA exists

    HAS_CUDA_EXT = True
except ImportError:  # expected on CPU-only machines: no message
    cuda_ext = None
    HAS_CUDA_EXT = False
