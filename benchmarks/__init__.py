"""The experiment harness: the scripts that made this project's tables and figures
(comparisons, studies, accuracy runs, the GPU evidence chain) and, in
:mod:`benchmarks.harness`, their shared code. See benchmarks/README.md for which command
made which results/ file.

The scripts are run as files; they put the repository root (and tools/, for the user
tools they reuse) on ``sys.path``. The harness sits above the driver and the tools: nothing
in sparsebalance/, megatron/training/ or tools/ imports it (tests/test_layers.py).
"""

import megatron.training  # noqa: E402,F401  (first: megatron-core's fusion compiles are deferred, see its __init__)
