"""The flags this project's own runs pass explicitly (comparisons, tools, tests, examples)."""

PROJECT_RUN_FLAGS = ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                     "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--make-vocab-size-divisible-by", "1"]
"""What this project's own runs (demo, comparisons, tests, examples) pass explicitly: the
architecture and schedule their results were measured with, which were this driver's
defaults before it took Megatron-LM's (learned absolute positions, tied embeddings,
linear decay, Adam beta2 0.999, vocabulary padded to 128). Untied embeddings also let
PP > 1 run on CPU (megatron-core syncs tied embeddings across stages on the GPU)."""
