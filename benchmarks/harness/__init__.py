"""The experiment harness, outside the library package ``sparsebalance``.

``compare``  end-to-end comparison of SparseBalance against the Megatron baseline and
             the peers: arms, cluster-scale simulation, real CPU runs, statistics,
             reports and figures (command line: ``benchmarks/compare.py``)
``longctx``  RULER-style long-context tasks, the training-mix writer, scoring, the
             model runner and attention recall (``benchmarks/eval_longctx.py``,
             ``benchmarks/make_longctx_data.py``, ``benchmarks/attention_recall.py``)
``run_flags``  the flags this project's own runs pass explicitly (``PROJECT_RUN_FLAGS``)

The dependency is one way: the harness imports ``sparsebalance`` (and may import the
driver, ``megatron.training``); nothing under ``sparsebalance/`` imports the harness.
Import it with the repository root on ``sys.path``, as ``benchmarks.harness.compare``.
"""
