"""Long-context accuracy of a pretrain_gpt.py checkpoint on the RULER-style tasks.

Builds the GPT from the arguments stored in the checkpoint (one process, PP=1,
TP=1, on CPU unless CUDA is present), loads the weights, and scores the
evaluation samples (``tools/make_longctx_data.py`` writes them; or generate
them on the fly with ``--tasks/--lengths/--num-samples``). Prints accuracy per
task and context length as a table, or as JSON with ``--json``.

Attention is dense by default, whatever the model was trained with;
``--sparse-attention`` evaluates with the block top-k sparse kernel
(``--sb-topk``/``--sb-block-size`` default to the checkpoint's values).

Modes: ``greedy`` (default; exact match of greedy decoding, one teacher-forced
forward per sample), ``generate`` (real token-by-token greedy decoding; slow),
``loglik`` (gold vs distractor answers by log-likelihood; chance = 1/(1 + distractors)).

Tiny CPU run::

    OMP_NUM_THREADS=2 .venv/bin/python tools/eval_longctx.py --load runs/tiny/ckpt \\
        --tasks niah_single --lengths 1024 --num-samples 4

GPU cluster run (one GPU is enough; the model is built with PP=1)::

    python tools/eval_longctx.py --load /lustre/ckpt/run1 --data /lustre/data/longctx/eval.jsonl \\
        --json --output results/run1_longctx.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PROG = "eval_longctx.py"


def fail(message: str, code: int = 2) -> NoReturn:
    """One error line on stderr, then exit."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


# --- the model: driver pieces, PP=1 ---------------------------------------------------


class EvalModelError(Exception):
    """Checkpoint cannot be used; reported as one line (``code`` is the exit status)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def eval_args(train_args, *, sparse: bool, sb_topk, sb_block_size, backend):
    """The checkpoint's arguments with the layout and attention of this evaluation."""
    import copy

    args = copy.copy(train_args)
    args.tensor_model_parallel_size = 1
    args.pipeline_model_parallel_size = 1
    args.num_layers_per_virtual_pipeline_stage = None
    args.virtual_pipeline_model_parallel_size = None
    args.sparse_attention = sparse
    if sb_topk is not None:
        args.sb_topk = sb_topk
    if sb_block_size is not None:
        args.sb_block_size = sb_block_size
    if backend is not None:
        args.sb_attention_backend = backend
    for name in ("sb_topk", "sb_block_size"):
        if sparse and (getattr(args, name, None) or 0) < 1:
            raise EvalModelError(f"--{name.replace('_', '-')} must be >= 1")
    return args


class EvalModel:
    """A single-process GPTModel seen as ``logits(seqs)`` (see sparsebalance.eval.runner)."""

    def __init__(self, gpt, args):
        self.gpt = gpt.eval()
        self.args = args
        self.max_positions = int(args.max_position_embeddings)
        self.device = next(gpt.parameters()).device

    def logits(self, seqs):
        """``[T_i]`` token tensors -> ``[T_i, V]`` logits, one packed THD forward."""
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        lens = [len(s) for s in seqs]
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        tokens = torch.cat(seqs).view(1, -1).to(self.device)
        pos = torch.cat([torch.arange(n) for n in lens]).view(1, -1).to(self.device)
        out = self.gpt(tokens, pos, None, packed_seq_params=packed)  # [1, T, V]
        return list(out[0].float().cpu().split(lens))

    def close(self) -> None:
        from megatron.training.initialize import shutdown

        shutdown()


def build_eval_model(train_args, state_loader, **attention) -> EvalModel:
    """Initialise a world of one, build the GPT as the driver does, load weights.

    ``state_loader(gpt)`` puts the checkpoint's weights into the (unwrapped)
    ``GPTModel``.
    """
    from megatron.training import quiet_optional_extras
    from megatron.training.initialize import initialize, use_cpu
    from megatron.training.model import build_model, transformer_config
    from megatron.training.tokenizer import vocab_size_for

    quiet_optional_extras()
    args = eval_args(train_args, **attention)
    initialize(args)
    config = transformer_config(args, use_cpu(args))
    vocab = vocab_size_for(args.tokenizer_type, getattr(args, "tokenizer_model", None), args.vocab_size)
    gpt = build_model(args, config, vocab)[0].module  # DDP wrapper not needed for inference
    state_loader(gpt)
    return EvalModel(gpt, args)


def load_eval_model(path: str, **attention) -> EvalModel:
    """The checkpoint at ``path`` as an :class:`EvalModel` (seam to the driver's format)."""
    try:
        from megatron.training import checkpointing
    except ImportError:
        raise EvalModelError("the driver's checkpoint reader (megatron/training/checkpointing.py) "
                             "is not available in this checkout", code=1) from None
    raise EvalModelError("checkpoint reading is not wired to the driver's format yet", code=1)


# --- command line ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from sparsebalance.eval.scoring import MODES

    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py --save")
    src = p.add_argument_group("samples (either --data or the generator flags)")
    src.add_argument("--data", default=None, help="eval.jsonl from tools/make_longctx_data.py")
    src.add_argument("--tasks", default="all", help="comma list of tasks, or all")
    src.add_argument("--lengths", default="1024,2048,4096", help="comma list of context lengths (tokens)")
    src.add_argument("--num-samples", type=int, default=20, help="samples per (task, length)")
    src.add_argument("--seed", type=int, default=0, help="generator seed (split 'eval')")
    src.add_argument("--limit", type=int, default=None, help="use at most this many samples per cell")
    p.add_argument("--mode", choices=MODES, default="greedy")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generate mode: default answer + 8")
    att = p.add_argument_group("attention used for evaluation (default: dense)")
    att.add_argument("--sparse-attention", action="store_true")
    att.add_argument("--sb-topk", type=int, default=None, help="default: the checkpoint's")
    att.add_argument("--sb-block-size", type=int, default=None, help="default: the checkpoint's")
    att.add_argument("--sb-attention-backend", default=None, help="default: the checkpoint's")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--output", default=None, help="also write the JSON report here (atomically)")
    p.add_argument("--quiet", action="store_true", help="no per-sample progress on stderr")
    return p


def load_samples(args) -> list:
    """Samples from ``--data`` or generated; usage errors exit 2."""
    from collections import Counter

    from sparsebalance.eval.mix import read_eval_set
    from sparsebalance.eval.tasks import TASKS, generate_set

    if args.limit is not None and args.limit < 1:
        fail("--limit must be >= 1")
    try:
        if args.data is not None:
            samples = read_eval_set(args.data)
        else:
            tasks = TASKS if args.tasks == "all" else tuple(t for t in args.tasks.split(",") if t)
            try:
                lengths = tuple(int(x) for x in args.lengths.split(",") if x)
            except ValueError:
                fail(f"--lengths: expected comma-separated integers, got {args.lengths!r}")
            if not tasks or not lengths:
                fail("--tasks and --lengths must not be empty")
            samples = generate_set(tasks, lengths, args.num_samples, args.seed, split="eval")
    except ValueError as e:
        fail(str(e))
    if args.limit is not None:
        seen: Counter = Counter()
        kept = []
        for s in samples:
            seen[(s.task, s.length)] += 1
            if seen[(s.task, s.length)] <= args.limit:
                kept.append(s)
        samples = kept
    return samples


def report(args, results, model_args, chance: float, seconds: float) -> dict:
    """JSON-serialisable report: accuracy table plus what produced it."""
    from sparsebalance.eval.scoring import accuracy_table, mean_accuracy

    table = accuracy_table(results)
    return {
        "checkpoint": os.path.abspath(args.load),
        "mode": args.mode,
        "chance": chance,
        "attention": "sparse" if args.sparse_attention else "dense",
        "sb_topk": model_args.sb_topk if args.sparse_attention else None,
        "sb_block_size": model_args.sb_block_size if args.sparse_attention else None,
        "samples": len(results),
        "mean": mean_accuracy(table),
        "accuracy": {t: {str(n): c for n, c in row.items()} for t, row in table.items()},
        "eval_seconds": round(seconds, 3),
        "threads": args.threads,
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    samples = load_samples(args)
    if args.sparse_attention is False and any(
            v is not None for v in (args.sb_topk, args.sb_block_size, args.sb_attention_backend)):
        fail("--sb-topk/--sb-block-size/--sb-attention-backend need --sparse-attention")
    if args.threads is not None and args.threads < 1:
        fail("--threads must be >= 1")
    if not os.path.isdir(args.load):
        fail(f"--load: {args.load} is not a directory")

    import torch

    from sparsebalance.eval.runner import evaluate
    from sparsebalance.eval.scoring import chance_level, format_table
    from sparsebalance.eval.tokenizer import get_tokenizer

    args.threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        model = load_eval_model(args.load, sparse=args.sparse_attention, sb_topk=args.sb_topk,
                                sb_block_size=args.sb_block_size, backend=args.sb_attention_backend)
    except EvalModelError as e:
        fail(str(e), code=e.code)
    too_long = [s.length for s in samples if s.length > model.max_positions]
    if too_long:
        fail(f"samples of {max(too_long)} tokens exceed the model's max positions {model.max_positions}")
    if max(len(s.distractors) for s in samples) == 0 and args.mode == "loglik":
        fail("--mode loglik needs samples with distractors")

    def progress(i, r):
        if not args.quiet:
            sys.stderr.write(f"\r[{i + 1}/{len(samples)}] {r.task} {r.length}: "
                             f"{'ok ' if r.correct else 'bad'} {r.prediction[:40]!r:44}")

    t0 = time.perf_counter()
    results = evaluate(samples, model.logits, get_tokenizer(), args.mode,
                       max_new_tokens=args.max_new_tokens, progress=progress)
    if not args.quiet:
        sys.stderr.write("\n")
    chance = chance_level(args.mode, 1 + min(len(s.distractors) for s in samples))
    rep = report(args, results, model.args, chance, time.perf_counter() - t0)
    model.close()
    if args.output:
        from sparsebalance.eval.mix import atomic_write_lines

        atomic_write_lines(args.output, [json.dumps(rep, indent=1)])
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        from sparsebalance.eval.scoring import accuracy_table

        print(format_table(accuracy_table(results)))
        print(f"mode {rep['mode']} (chance {rep['chance']:.3f}), attention {rep['attention']}, "
              f"{rep['samples']} samples in {rep['eval_seconds']:.1f} s on {args.threads} threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
