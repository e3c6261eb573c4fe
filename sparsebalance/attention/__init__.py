"""SparseBalance: attention (dense and sparse core_attention modules, their spec).

Import-light on purpose: megatron-core is only imported when a module class or
spec builder is first used (``from sparsebalance.attention import SparseAttention``).
"""

_LAZY = {
    "SparseAttention": "sparsebalance.attention.sparse",
    "get_gpt_layer_sparse_spec": "sparsebalance.attention.sparse",
    "CausalVarlenAttention": "sparsebalance.attention.dense",
    "get_gpt_layer_spec": "sparsebalance.attention.spec",
    "get_gpt_layer_dense_spec": "sparsebalance.attention.spec",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparsebalance.attention' has no attribute {name!r}")
