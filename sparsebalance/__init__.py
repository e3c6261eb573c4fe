"""SparseBalance: sparsity-aware batching and dynamic sparsity tuning for
long-context training on top of megatron-core.

The package is importable without Megatron; only ``megatron/training`` (the
driver) and ``sparsebalance.attention`` touch megatron-core.
"""

__version__ = "0.1.0"
