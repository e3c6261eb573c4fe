"""The flags this project's own runs pass explicitly (comparisons, tools, tests, examples)."""

PROJECT_RUN_FLAGS = ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                     "--lr-decay-style", "cosine", "--adam-beta2", "0.95", "--make-vocab-size-divisible-by", "1",
                     "--hidden-dropout", "0", "--attention-dropout", "0", "--transformer-impl", "local",
                     "--tokenizer-type", "ByteTokenizer", "--split", "98,2,0"]
"""What this project's own runs (demo, comparisons, tests, examples) pass explicitly: the
architecture and schedule their results were measured with, which were this driver's
defaults before it took Megatron-LM's (learned absolute positions, tied embeddings,
linear decay, Adam beta2 0.999, vocabulary padded to 128, dropout 0.1, Transformer Engine's
layers, the GPT-2 BPE tokenizer, split 969,30,1). Untied embeddings also let PP > 1 run on CPU (megatron-core
syncs tied embeddings across stages on the GPU); without dropout, runs and resumes stay
bit-for-bit comparable (checkpoints hold no RNG state)."""
