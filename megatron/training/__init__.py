"""SparseBalance's training driver on top of megatron-core (``megatron.core``).

``megatron/`` has no ``__init__.py``: it is a namespace package, so this
``megatron.training`` and pip's ``megatron.core`` live side by side.
"""

import warnings


def quiet_optional_extras() -> None:
    """Silence megatron-core's per-module "Transformer Engine and Apex are not installed"
    warnings: on CPU their absence is the expected configuration, not news."""
    warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
    # TransformerConfig's default cuda_graph_scope trips its own deprecation warning.
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")
