"""megatron.training's start-up hook: megatron-core's fusion compiles built at first call."""

import json
import os
import subprocess
import sys

from megatron.training import _deferred_compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _recording_compile():
    calls = []

    def real(model, **kwargs):
        calls.append((model, kwargs))
        return lambda *a, **k: ("compiled", model(*a, **k))

    return real, calls


def test_function_compiles_once_at_first_call_with_the_same_arguments():
    real, calls = _recording_compile()
    compile = _deferred_compile(real)

    def f(x, y=1):
        return x + y

    wrapped = compile(f, dynamic=False)
    assert calls == []
    assert wrapped.__wrapped__ is f and wrapped.__name__ == "f"
    assert wrapped(2, y=3) == ("compiled", 5)
    assert wrapped(4) == ("compiled", 5)
    assert calls == [(f, {"dynamic": False})]


def test_decorator_form_and_modules_pass_through():
    real, calls = _recording_compile()
    compile = _deferred_compile(real)

    @compile(mode="max-autotune")
    def g(x):
        return 2 * x

    assert calls == []
    assert g(3) == ("compiled", 6)
    assert calls == [(g.__wrapped__, {"mode": "max-autotune"})]

    class Module:  # anything with parameters() is compiled at once, as torch.compile would
        def parameters(self):
            return iter(())

        def __call__(self, x):
            return x

    m = Module()
    compile(m)
    assert calls[-1] == (m, {})


def test_a_fresh_process_imports_megatron_core_without_torchs_compiler_or_wandb():
    probe = (
        "import sys, json\n"
        "import megatron.training\n"
        "import megatron.core.models.gpt, megatron.core.fusions.fused_bias_gelu as fbg, megatron.core.jit as jit\n"
        "import megatron.core.timers as timers, megatron.core.inference.contexts.dynamic_context as dc\n"
        "before = {'dynamo': 'torch._dynamo' in sys.modules, 'wandb': 'wandb' in sys.modules,\n"
        "    'fuser': jit.jit_fuser.__qualname__, 'wrapped': fbg.bias_gelu.__wrapped__.__module__,\n"
        "    'have_wandb': dc.HAVE_WANDB}\n"
        "version = timers.wandb.__version__\n"  # the first read imports W&B itself
        "import wandb\n"
        "print(json.dumps(dict(before, version=version == wandb.__version__, equal=timers.wandb == wandb,\n"
        "    same=dc.wandb == wandb, stand_in='wandb' in sys.modules and type(sys.modules['wandb']).__name__)))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "wandb": False, "fuser": "_deferred_compile.<locals>.compile",
                   "wrapped": "megatron.core.fusions.fused_bias_gelu", "have_wandb": True,
                   "version": True, "equal": True, "same": True, "stand_in": "module"}
