"""Long-context accuracy of a pretrain_gpt.py checkpoint on the RULER-style tasks.

Builds the GPT the way the driver does (``megatron/training/model.py``) in one
process with PP=1, TP=1 (on CPU unless CUDA is present), from the arguments
stored in the checkpoint or, since pretrain_gpt.py checkpoints do not store them
yet, from ``--train-args`` (the model flags the run was trained with), and loads
the latest checkpoint's weights with the driver's ``load_weights`` (dist
checkpointing: a PP=2 checkpoint loads into the PP=1 model). Then scores the
evaluation samples (``tools/make_longctx_data.py`` writes them; or generate them
on the fly with ``--tasks/--lengths/--num-samples``) and prints accuracy per
task and context length as a table, or as JSON with ``--json``.

Attention is dense by default, whatever the model was trained with;
``--sparse-attention`` evaluates with the block top-k sparse kernel
(``--sb-topk``/``--sb-block-size`` default to the checkpoint's values).

Modes: ``greedy`` (default; exact match of greedy decoding, one teacher-forced
forward per sample; also reports ``token_accuracy``, the fraction of answer tokens
predicted right given the gold prefix, which moves before exact match does, and
``digit_accuracy``, the same over the digits of the answer: the retrieved values),
``generate`` (real token-by-token greedy decoding; slow),
``loglik`` (gold vs distractor answers by log-likelihood; chance = 1/(1 + distractors)).

A converted pretrained model (``convert.py gguf-to-megatron`` / ``hf-to-megatron``: ``LOAD/model_flags.txt``
and ``LOAD/hf``) evaluates with ``--real-model``: its own tokenizer and chat template, greedy decoding
with the prompt prefilled under the arm's block routing and the answer decoded with per-token routing,
under dense, static top-k, threshold routing and SparseBalance's budgets (``tools/real_accuracy.py``'s
retrieval, which this hands ``--tasks``, ``--lengths``, ``--num-samples``, ``--seed``, ``--sb-topk``,
``--sb-block-size``, ``--threads``, ``--json`` and ``--output`` to)::

    OMP_NUM_THREADS=2 .venv/bin/python tools/eval_longctx.py --load runs/models/smollm2-135m --real-model \
        --tasks niah_single,niah_multikey,variable_tracking --lengths 2048,4096,8192 --num-samples 2

Tiny CPU run::

    OMP_NUM_THREADS=2 .venv/bin/python tools/eval_longctx.py --load runs/longctx-smoke/dense/seed1/ckpt \\
        --train-args "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 1024" \\
        --tasks niah_single --lengths 1024 --num-samples 4

GPU cluster run (one GPU is enough; the model is built with PP=1)::

    python tools/eval_longctx.py --load /lustre/ckpt/run1 --data /lustre/data/longctx/eval.jsonl \\
        --train-args "$(cat /lustre/ckpt/run1/model_flags.txt)" --json --output /lustre/ckpt/run1/longctx.json
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

    from megatron.training.arguments import build_parser

    args = copy.copy(train_args)
    # Checkpoints saved before a flag existed lack it: take the flag's default.
    for name, value in vars(build_parser().parse_args([])).items():
        if not hasattr(args, name):
            setattr(args, name, value)
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
    """A single-process GPTModel seen as ``logits(seqs)`` (see tools.harness.longctx.runner)."""

    def __init__(self, gpt, args):
        self.gpt = gpt.eval()
        self.args = args
        self.max_positions = int(args.max_position_embeddings)
        self.device = next(gpt.parameters()).device
        self.iteration = None  # set by load_eval_model

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


def build_eval_model(train_args, load_weights, **attention) -> EvalModel:
    """Initialise a world of one, build the GPT as the driver does, load weights.

    ``load_weights(chunks)`` fills the driver's (DDP-wrapped) model chunks.
    """
    from megatron.training.initialize import initialize, use_cpu
    from megatron.training.model import build_model, transformer_config
    from megatron.training.tokenizer import padded_vocab_size, vocab_size_for

    args = eval_args(train_args, **attention)
    if args.sparse_attention:
        try:
            import sparsebalance.attention.sparse  # noqa: F401
        except ImportError as e:
            raise EvalModelError(f"--sparse-attention: the sparse attention module is not available ({e})",
                                 code=1) from None
    initialize(args)
    try:
        config = transformer_config(args, use_cpu(args))
        vocab = padded_vocab_size(
            vocab_size_for(args.tokenizer_type, getattr(args, "tokenizer_model", None), args.vocab_size),
            args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
        chunks = build_model(args, config, vocab)
        load_weights(chunks)
    except BaseException:
        from megatron.training.initialize import shutdown

        shutdown()
        raise
    return EvalModel(chunks[0].module, args)  # the DDP wrapper is not needed for inference


def stored_train_args(root: str, iteration: int):
    """The argparse Namespace saved in the checkpoint's common state, or None."""
    from megatron.core import dist_checkpointing

    from megatron.training.checkpointing import iter_dir

    common = dist_checkpointing.load_common_state_dict(iter_dir(root, iteration))
    stored = common.get("args") if isinstance(common, dict) else None
    if stored is None:
        return None
    return argparse.Namespace(**stored) if isinstance(stored, dict) else stored


def parse_train_args(flags: str):
    """``--train-args``: pretrain_gpt.py's flags -> the Namespace the driver builds the model from."""
    import shlex

    from megatron.training.arguments import build_parser, derive_model_fields

    parser = build_parser()
    parser.error = lambda message: fail(f"--train-args: {message}")  # one line, exit 2
    args = parser.parse_args(shlex.split(flags))
    # The derived model fields arguments.validate() fills (it also checks data files,
    # which evaluation does not need).
    derive_model_fields(args)
    args.virtual_pipeline_model_parallel_size = None
    return args


def load_eval_model(root: str, train_flags, **attention) -> EvalModel:
    """The latest checkpoint under ``root`` (pretrain_gpt.py's --save) as an EvalModel.

    The model is rebuilt from the arguments stored in the checkpoint; when it has
    none, from ``train_flags`` (the pretrain_gpt.py flags it was trained with).
    Weights load through megatron's dist_checkpointing, whose global layer keys
    let a PP=2 (or any layout) checkpoint load into this PP=1 model.
    """
    from megatron.training.checkpointing import load_weights, read_tracker

    try:
        iteration = read_tracker(root)
    except ValueError as e:
        raise EvalModelError(str(e)) from None
    if iteration is None:
        raise EvalModelError(f"--load: no checkpoint in {root} (no latest_checkpointed_iteration.txt)")
    stored = stored_train_args(root, iteration)
    if stored is None and train_flags is None:
        raise EvalModelError(f"--load: checkpoint {root} does not store its training arguments; "
                             f"pass the pretrain_gpt.py model flags with --train-args")
    train_args = parse_train_args(train_flags) if train_flags is not None else stored

    def weights(chunks):
        try:
            load_weights(root, chunks)
        except ValueError as e:
            raise EvalModelError(str(e)) from None

    model = build_eval_model(train_args, weights, **attention)
    model.iteration = iteration
    return model


def open_eval_model(root: str, train_flags, threads, fail_fn, **attention):
    """``load_eval_model`` for a command line: quiet imports, ``threads`` torch threads
    (default: OMP_NUM_THREADS, else torch's), load errors to ``fail_fn(message, code)``.

    Returns ``(model, threads)``.
    """
    import warnings

    import torch

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    # torch.distributed.checkpoint's deprecation notices while megatron reads the
    # checkpoint are not actionable here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron\.core\.dist_checkpointing")
    threads = threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return load_eval_model(root, train_flags, **attention), threads
    except EvalModelError as e:
        fail_fn(str(e), e.code)


# --- command line ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from tools.harness.longctx.scoring import MODES

    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py --save")
    p.add_argument("--train-args", default=None,
                   help="pretrain_gpt.py flags of the run (model shape), for checkpoints that do not "
                        "store their arguments; overrides the stored ones")
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
    p.add_argument("--per-position", action="store_true",
                   help="also print, per task and length, the accuracy of each answer token given "
                        "the gold prefix (greedy mode; in the JSON report always)")
    p.add_argument("--quiet", action="store_true", help="no per-sample progress on stderr")
    p.add_argument("--real-model", action="store_true",
                   help="LOAD is a converted pretrained model (model_flags.txt, hf/): tools/real_accuracy.py's "
                        "retrieval arms, its tokenizer and chat template")
    return p


REAL_TASKS = "niah_single,niah_multikey,variable_tracking"


def real_model_argv(args) -> list:
    """tools/real_accuracy.py's command line for ``--real-model`` (retrieval only)."""
    tasks = REAL_TASKS if args.tasks == "all" else args.tasks
    argv = ["--load", args.load, "--num-microbatches", "0", "--tasks", tasks,
            "--lengths", args.lengths, "--num-samples", str(args.num_samples), "--seed", str(args.seed)]
    for flag, value in (("--topk", args.sb_topk), ("--block-size", args.sb_block_size), ("--threads", args.threads),
                        ("--out", args.output)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + (["--json"] if args.json else [])


def load_samples(args) -> list:
    """Samples from ``--data`` or generated; usage errors exit 2."""
    from collections import Counter

    from tools.harness.longctx.mix import read_eval_set
    from tools.harness.longctx.tasks import TASKS, generate_set

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


def report(args, results, model_args, iteration: int, chance: float, seconds: float) -> dict:
    """JSON-serialisable report: accuracy table plus what produced it."""
    from tools.harness.longctx.scoring import accuracy_table, mean_accuracy, mean_token_accuracy

    table = accuracy_table(results)
    return {
        "checkpoint": os.path.abspath(args.load),
        "iteration": iteration,
        "mode": args.mode,
        "chance": chance,
        "attention": "sparse" if args.sparse_attention else "dense",
        "sb_topk": model_args.sb_topk if args.sparse_attention else None,
        "sb_block_size": model_args.sb_block_size if args.sparse_attention else None,
        "model": {k: getattr(model_args, k, None) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "seed")},
        "samples": len(results),
        "mean": mean_accuracy(table),
        "token_accuracy": mean_token_accuracy(table),
        "digit_accuracy": mean_token_accuracy(table, "digit_accuracy"),
        "accuracy": {t: {str(n): c for n, c in row.items()} for t, row in table.items()},
        "eval_seconds": round(seconds, 3),
        "threads": args.threads,
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.real_model:
        if args.data is not None or args.mode != "greedy" or args.train_args is not None:
            fail("--real-model generates its samples in the model's tokens and decodes greedily: "
                 "--data, --mode and --train-args do not apply")
        import real_accuracy

        return real_accuracy.main(real_model_argv(args))
    samples = load_samples(args)
    if args.sparse_attention is False and any(
            v is not None for v in (args.sb_topk, args.sb_block_size, args.sb_attention_backend)):
        fail("--sb-topk/--sb-block-size/--sb-attention-backend need --sparse-attention")
    if args.threads is not None and args.threads < 1:
        fail("--threads must be >= 1")
    if args.per_position and args.mode != "greedy":
        fail("--per-position needs --mode greedy (answer tokens scored under teacher forcing)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        fail("--max-new-tokens must be >= 1")
    if args.mode == "loglik" and not all(s.distractors for s in samples):
        fail("--mode loglik needs samples with distractors")
    if not os.path.isdir(args.load):
        fail(f"--load: {args.load} is not a directory")

    model, args.threads = open_eval_model(args.load, args.train_args, args.threads, fail,
                                          sparse=args.sparse_attention, sb_topk=args.sb_topk,
                                          sb_block_size=args.sb_block_size, backend=args.sb_attention_backend)
    from tools.harness.longctx.runner import evaluate
    from tools.harness.longctx.scoring import chance_level, format_table
    from tools.harness.longctx.tokenizer import get_tokenizer

    too_long = [s.length for s in samples if s.length > model.max_positions]
    if too_long:
        fail(f"samples of {max(too_long)} tokens exceed the model's max positions {model.max_positions}")

    def progress(i, r):
        if not args.quiet:
            sys.stderr.write(f"\r[{i + 1}/{len(samples)}] {r.task} {r.length}: "
                             f"{'ok ' if r.correct else 'bad'} {r.prediction[:40]!r:44}")

    t0 = time.perf_counter()
    try:
        results = evaluate(samples, model.logits, get_tokenizer(), args.mode,
                           max_new_tokens=args.max_new_tokens, progress=progress)
    finally:
        model.close()
    if not args.quiet:
        sys.stderr.write("\n")
    chance = chance_level(args.mode, 1 + min(len(s.distractors) for s in samples))
    rep = report(args, results, model.args, model.iteration, chance, time.perf_counter() - t0)
    if args.output:
        from sparsebalance.io import atomic_write_text

        atomic_write_text(args.output, json.dumps(rep, indent=1) + "\n")
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        from tools.harness.longctx.scoring import accuracy_table

        print(format_table(accuracy_table(results)))
        print(f"mode {rep['mode']} (chance {rep['chance']:.3f}), attention {rep['attention']}, "
              f"{rep['samples']} samples in {rep['eval_seconds']:.1f} s on {args.threads} threads")
        if rep["token_accuracy"] is not None:
            print(f"answer tokens right given the gold prefix (teacher forcing): {rep['token_accuracy']:.3f}")
        digits = format_table(accuracy_table(results), "digit_accuracy")
        if "\n" in digits:
            print("\nvalue digits right given the gold prefix (teacher forcing, chance 0.1):")
            print(digits)
        if args.per_position:
            print("\nper answer token, right given the gold prefix (the terminator last):")
            for task, row in rep["accuracy"].items():
                for n, c in row.items():
                    if "position_accuracy" in c:
                        print(f"{task:<18} {n:>6}  " + " ".join(f"{a:.2f}" for a in c["position_accuracy"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
