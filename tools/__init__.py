"""User tools and, in :mod:`tools.harness`, the experiment harness.

The scripts here (``tools/compare.py``, ``tools/eval_longctx.py``, ...) are run as
files; they put the repository root on ``sys.path`` so that ``sparsebalance`` and
``tools.harness`` import. This file makes ``tools`` a regular package so that a
stray top-level ``tools`` elsewhere on the path cannot shadow it.
"""
