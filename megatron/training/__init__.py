"""SparseBalance's training driver on top of megatron-core (``megatron.core``).

``megatron/`` has no ``__init__.py``: it is a namespace package, so this
``megatron.training`` and pip's ``megatron.core`` live side by side.
"""

import functools
import importlib.abc
import importlib.machinery
import sys
import warnings


def quiet_optional_extras() -> None:
    """Silence megatron-core's per-module "Transformer Engine and Apex are not installed"
    warnings: on CPU their absence is the expected configuration, not news."""
    warnings.filterwarnings("ignore", message=r".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
    # TransformerConfig's default cuda_graph_scope trips its own deprecation warning.
    warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")


def _deferred_compile(real):
    """``torch.compile`` as megatron-core's fusion decorator uses it, built at the wrapped
    function's first call instead of at decoration (same arguments, same compiled function)."""

    def compile(model=None, **kwargs):  # noqa: A001 - stands in for torch.compile
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        if not callable(model) or hasattr(model, "parameters"):  # a module: nothing to defer
            return real(model, **kwargs)
        built = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            if not built:
                built.append(real(model, **kwargs))
            return built[0](*args, **kw)

        return first_call_compiles

    return compile


class _DeferFuserCompile(importlib.abc.MetaPathFinder):
    """Import hook for ``megatron.core.jit``, once: after the module runs, its ``jit_fuser``
    (``torch.compile`` on torch >= 2.2) becomes :func:`_deferred_compile`'s stand-in.

    Why: megatron-core decorates its fusion functions with ``jit_fuser`` at import, and the
    first ``torch.compile`` call imports torch's compiler stack (dynamo, inductor): about
    3 s of CPU, a third of every process's start-up here, although ``torch.compile``
    compiles nothing until the wrapped function is first called. Deferring the call to
    that moment changes nothing a run computes; a process that never calls a fused
    function (the CPU path, the tools) never pays for the compiler's import."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import torch

            if module.jit_fuser is torch.compile:
                module.jit_fuser = _deferred_compile(torch.compile)

        spec.loader.exec_module = exec_module
        return spec


if "megatron.core.jit" not in sys.modules and not any(isinstance(f, _DeferFuserCompile) for f in sys.meta_path):
    sys.meta_path.insert(0, _DeferFuserCompile())
