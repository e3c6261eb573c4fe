"""Long-context capability evaluation: RULER-style synthetic tasks over the
byte tokenizer, a training-mix writer, scoring, and a model-agnostic runner.

``tasks``/``text``/``mix``/``scoring`` need only numpy; ``runner`` needs torch;
``tokenizer`` is the driver's byte tokenizer (``benchmarks/eval_longctx.py`` builds the
model). ``recall`` measures how much dense attention block top-k keeps.
"""

from benchmarks.harness.longctx.scoring import Result, accuracy_table, exact_match, format_table, mean_accuracy
from benchmarks.harness.longctx.tasks import ANSWER_END, TASKS, Sample, TaskConfig, generate, generate_set

__all__ = [
    "ANSWER_END", "TASKS", "Result", "Sample", "TaskConfig", "accuracy_table", "exact_match",
    "format_table", "generate", "generate_set", "mean_accuracy",
]
