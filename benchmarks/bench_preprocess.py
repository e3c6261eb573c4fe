"""tools/preprocess_data.py with 1 and N workers on a generated JSONL: wall times and file equality (JSON).

Generates ``--mb`` MB of JSONL (seeded word salad, documents of lognormal length), builds a
byte-level BPE tokenizer offline with the ``tokenizers`` library (trained on the first
documents, eos ``</s>`` in its tokenizer_config.json), then runs Megatron-LM's preprocessing
line ``--json-keys text --append-eod --tokenizer-type HuggingFaceTokenizer`` once with one
worker and once with ``--workers N``, and checks that both wrote the same bytes as
megatron-core's ``IndexedDatasetBuilder`` fed the same tokens. Prints one JSON object; the
load average before and after is in it (a shared machine makes the ratio noisy).

    .venv/bin/python benchmarks/bench_preprocess.py --mb 50 --workers 2 --workdir runs/bench_preprocess
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
WORDS = 5000
PROG = "bench_preprocess.py"


def make_corpus(path: str, mb: float, seed: int) -> int:
    """Write ~``mb`` MB of ``{"text": ...}`` lines; returns the documents written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(WORDS)]
    zipf = 1.0 / np.arange(1, WORDS + 1)
    zipf /= zipf.sum()
    target, written, n = int(mb * 2**20), 0, 0
    with open(path, "w") as f:
        while written < target:
            words = rng.choice(WORDS, size=int(rng.lognormal(5.5, 1.0)) + 1, p=zipf)
            line = json.dumps({"text": " ".join(vocab[w] for w in words) + ".", "id": n}) + "\n"
            f.write(line)
            written += len(line)
            n += 1
    return n


def make_tokenizer(folder: str, corpus: str, vocab_size: int) -> str:
    """A byte-level BPE trained on the corpus' first 2,000 documents, saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus) as f:
        sample = [json.loads(line)["text"] for line in itertools.islice(f, 2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    return folder


def reference(prefix: str, corpus: str, tokenizer: str) -> None:
    """megatron-core's builder fed the tokens Megatron-LM's tool would feed it."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))
    eod = tok.token_to_id("</s>")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(tok.get_vocab_size()))
    with open(corpus) as f:
        for line in f:
            ids = tok.encode(json.loads(line)["text"]).ids
            ids = ids + [eod] if ids else ids
            builder.add_document(np.asarray(ids), [len(ids)] if ids else [])
    builder.finalize(prefix + ".idx")


def run(corpus: str, tokenizer: str, prefix: str, workers: int) -> float:
    """Wall seconds of one preprocess_data.py process."""
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", prefix, "--json-keys", "text", "--append-eod", "--workers", str(workers),
           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--log-interval", "100000000"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def same(a: str, b: str) -> bool:
    return all(open(a + ext, "rb").read() == open(b + ext, "rb").read() for ext in (".bin", ".idx"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="JSONL size, MB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="runs/bench_preprocess")
    a = p.parse_args(argv)
    if a.mb <= 0 or a.workers < 2 or a.vocab_size < 300:
        from megatron.training.arguments import usage_error

        usage_error("need --mb > 0, --workers >= 2 and --vocab-size >= 300 (the byte alphabet and merges)",
                    prog=PROG)
    os.makedirs(a.workdir, exist_ok=True)
    corpus = os.path.join(a.workdir, "corpus.jsonl")
    docs = make_corpus(corpus, a.mb, a.seed)
    tokenizer = make_tokenizer(os.path.join(a.workdir, "tokenizer"), corpus, a.vocab_size)
    load_before = os.getloadavg()
    one = run(corpus, tokenizer, os.path.join(a.workdir, "one"), 1)
    many = run(corpus, tokenizer, os.path.join(a.workdir, "many"), a.workers)
    load_after = os.getloadavg()
    ref = os.path.join(a.workdir, "ref")
    reference(ref, corpus, tokenizer)
    out = {"input_mb": round(os.path.getsize(corpus) / 2**20, 2), "documents": docs, "workers": a.workers,
           "cpus": os.cpu_count(), "wall_s_1_worker": round(one, 2), f"wall_s_{a.workers}_workers": round(many, 2),
           "ratio": round(many / one, 3),
           "equal_1_vs_n_workers": same(os.path.join(a.workdir, "one_text_document"),
                                        os.path.join(a.workdir, "many_text_document")),
           "equal_to_megatron_core_builder": same(os.path.join(a.workdir, "one_text_document"), ref),
           "loadavg_1m_before": round(load_before[0], 2), "loadavg_1m_after": round(load_after[0], 2)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
