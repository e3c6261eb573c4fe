"""gpu-check (benchmarks/gpu_check.py) parts: the train / profile / accuracy stages and the report."""
