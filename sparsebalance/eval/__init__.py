"""Long-context capability evaluation: RULER-style synthetic tasks over the
byte tokenizer, a training-mix writer, scoring, and a model-agnostic runner.

``tasks``/``text``/``mix``/``scoring`` need only numpy; ``runner`` needs torch;
nothing here imports Megatron (``tools/eval_longctx.py`` builds the model).
"""

from sparsebalance.eval.scoring import Result, accuracy_table, exact_match, format_table, mean_accuracy
from sparsebalance.eval.tasks import ANSWER_END, TASKS, Sample, TaskConfig, generate, generate_set

__all__ = [
    "ANSWER_END", "TASKS", "Result", "Sample", "TaskConfig", "accuracy_table", "exact_match",
    "format_table", "generate", "generate_set", "mean_accuracy",
]
