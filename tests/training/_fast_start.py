"""Run a script as ``__main__`` with megatron-core's import made cheaper (test launches).

Usage: ``python _fast_start.py SCRIPT ARGS...`` runs ``SCRIPT`` exactly as ``python SCRIPT
ARGS...`` would (``sys.argv``, ``__file__``, exit status, signals), after importing
``megatron.core`` once with ``torch.compile`` deferred.

Why: megatron-core applies ``torch.compile`` to its fusion functions at import
(``megatron/core/jit.py``: ``jit_fuser = torch.compile``). The first such call imports
torch's inductor backend, about a third of a CPU process's start-up, and every test
launch pays it although no fused function runs here. ``torch.compile`` itself compiles
nothing until the wrapped function is first called, so building each wrapper at its
first call instead of at import changes nothing a run computes: a fused function that
does run gets the real ``torch.compile`` with the same arguments, once. After the
import ``torch.compile`` is the real one again (e.g. for sparsebalance's flex path).
"""

import functools
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _deferred_compile(real):
    def compile(model=None, **kwargs):  # noqa: A001 - stands in for torch.compile
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        built = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            if not built:
                built.append(real(model, **kwargs))
            return built[0](*args, **kw)

        return first_call_compiles

    return compile


def import_megatron_core() -> None:
    """Import megatron.core (and the torch it needs) with torch.compile deferred."""
    import warnings

    import torch

    from megatron.training import quiet_optional_extras

    real = torch.compile
    torch.compile = _deferred_compile(real)
    try:
        with warnings.catch_warnings():  # what every launched script silences (then restored)
            quiet_optional_extras()
            import megatron.core  # noqa: F401
            import megatron.core.jit  # noqa: F401  (binds jit_fuser now, to the deferred one)
    finally:
        torch.compile = real


if __name__ == "__main__":
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it
    sys.path.append(ROOT)  # megatron.training, for the import below only
    import_megatron_core()
    sys.path.remove(ROOT)
    runpy.run_path(script, run_name="__main__")
