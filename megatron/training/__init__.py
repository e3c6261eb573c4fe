"""SparseBalance's training driver on top of megatron-core (``megatron.core``).

``megatron/`` has no ``__init__.py``: it is a namespace package, so this
``megatron.training`` and pip's ``megatron.core`` live side by side.
"""

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
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


class _Deferred(types.ModuleType):
    """Stands for an optional package in the globals of a megatron-core module that imports
    it at import time only to have it at hand (``try: import wandb``): the real package
    is imported at the first attribute read, and compares equal to the stand-in. It has
    the package's ``__file__``: code that scans ``sys.modules`` (``inspect.getmodule``)
    reads it from every module, and must not import the package by doing so."""

    def __init__(self, name, origin):
        super().__init__(name)
        self.__file__ = origin

    def __getattr__(self, attr):
        name = self.__name__
        if sys.modules.get(name) is self:  # never left there, but a lookup must not recurse
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)

    def __eq__(self, other):
        return other is self or other is sys.modules.get(self.__name__)

    def __hash__(self):
        return hash(self.__name__)


OPTIONAL_AT_IMPORT = {
    "megatron.core.inference.contexts.dynamic_context": ("wandb",),
    "megatron.core.inference.engines.dynamic_engine": ("wandb",),
    "megatron.core.timers": ("wandb",),
}
"""megatron-core modules -> optional packages each imports at import time and uses only
when asked: W&B (with its pydantic and protobuf), ~0.8 s of CPU of every process's start-up
here (4.37 -> 3.55 s), paid by runs that never log to W&B. (Triton is not deferred: another
megatron-core module decorates kernels with it at import.)"""


class _DeferAtImport(importlib.abc.MetaPathFinder):
    """Import hook, one pass over megatron-core's import:

    - ``megatron.core.jit``: its ``jit_fuser`` (``torch.compile`` on torch >= 2.2) becomes
      :func:`_deferred_compile`'s stand-in. megatron-core decorates its fusion functions
      with it at import, and the first ``torch.compile`` call imports torch's compiler
      stack (dynamo, inductor): about 3 s of CPU, although it compiles nothing until the
      wrapped function is first called. Deferring the call to that moment changes nothing
      a run computes; a process that never calls a fused function never pays for it.
    - the modules of :data:`OPTIONAL_AT_IMPORT`: while one runs, each of its optional
      packages that is installed but not yet imported is a :class:`_Deferred` in
      ``sys.modules`` (taken out again when the module is done), so the module binds the
      stand-in and its ``HAVE_*`` flag reads as before. Nothing else sees the stand-in."""

    def __init__(self):
        self.pending = {"megatron.core.jit", *OPTIONAL_AT_IMPORT}

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            if name == "megatron.core.jit":
                run(module)
                import torch

                if module.jit_fuser is torch.compile:
                    module.jit_fuser = _deferred_compile(torch.compile)
                return
            stand_ins = {}
            for extra in OPTIONAL_AT_IMPORT[name]:
                found = None if extra in sys.modules else importlib.util.find_spec(extra)
                if found is not None:
                    stand_ins[extra] = sys.modules[extra] = _Deferred(extra, found.origin)
            try:
                run(module)
            finally:
                for extra, stand_in in stand_ins.items():
                    if sys.modules.get(extra) is stand_in:
                        del sys.modules[extra]

        spec.loader.exec_module = exec_module
        return spec


if "megatron.core" not in sys.modules and not any(isinstance(f, _DeferAtImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _DeferAtImport())
