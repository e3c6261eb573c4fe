"""The user's tools (Megatron-LM's convention): preprocess_data, checkpoint conversion,
the latency profile, the launch-line check, corpora and kernel benchmarks, timelines.

The scripts are run as files; they put the repository root on ``sys.path`` so that
``sparsebalance`` and ``megatron.training`` import. This file makes ``tools`` a regular
package so that a stray top-level ``tools`` elsewhere on the path cannot shadow it. Nothing
here imports ``benchmarks`` (the experiment harness sits above the tools).
"""
