"""GPT training on megatron-core with packed documents (Megatron-LM's flag names; CPU/gloo or GPU/NCCL).

Tiny CPU run (2 processes, 1F1B over gloo; what ``make demo`` does)::

    .venv/bin/python tools/make_corpus.py --output-prefix data/corpus
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 pretrain_gpt.py --data-path data/corpus \
        --untie-embeddings-and-output-weights --position-embedding-type rope \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
        --seq-length 512 --global-batch-size 4 --train-iters 30 --lr 1e-3

CPU run with SparseBalance (SAB packing + critical-path DST), after profiling the layer
once with the same model flags and thread count (``--quick``: a small grid, < 1 min)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/profile_latency.py --quick --output results/cpu_profile.json \
        --sparse-attention --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
        --seq-length 1024 --sb-block-size 32 --sb-topk 4
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 pretrain_gpt.py --data-path data/corpus \
        --untie-embeddings-and-output-weights --position-embedding-type rope \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
        --seq-length 1024 --global-batch-size 4 --train-iters 30 --lr 1e-3 \
        --sparse-balance --sb-block-size 32 --sb-topk 4 --sb-profile results/cpu_profile.json \
        --summary-json runs/sb_cpu/summary.json --sb-timeline runs/sb_cpu/timeline

(A Megatron-LM launch script runs unchanged; ``tools/check_launch_script.py SCRIPT`` says
what each of its flags does here. ``--sb-cost-model h100-analytic`` instead of
``--sb-profile`` plans with the analytic H100 model; ``--sb-dst anchor --sb-anchor mean
--sb-p 0.1`` is the paper's policy.)

GPU cluster run (per node; see examples/ for Slurm)::

    torchrun --nnodes $NNODES --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \
        pretrain_gpt.py --data-path /lustre/data/corpus --tokenizer-type HuggingFaceTokenizer \
        --tokenizer-model /lustre/qwen2.5/tokenizer.json --num-layers 36 --hidden-size 2048 \
        --num-attention-heads 16 --group-query-attention --num-query-groups 2 --seq-length 32768 --bf16 \
        --pipeline-model-parallel-size 4 --global-batch-size 64 --train-iters 1000 \
        --save /lustre/ckpt --load /lustre/ckpt --exit-signal-handler

Exit codes: 0 done (or preempted and saved), 2 bad command line / input, 1 runtime error.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _fail(message: str, code: int) -> "NoReturn":  # noqa: F821
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
    sys.stderr.write(f"pretrain_gpt.py: error: {prefix}{message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _warn(message: str) -> None:
    """One warning line on stderr, from rank 0 only."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"pretrain_gpt.py: warning: {message}\n")
        sys.stderr.flush()


def _check_inputs(args) -> None:
    """Input checks that need no process group: tokenizer files, dataset readable (or
    --mock-data written), --load has a checkpoint (none: a warning and a fresh start, as in
    Megatron-LM, unless --finetune or --exit-on-missing-checkpoint), --save writable with room
    for a checkpoint and not in use by a live run."""
    from megatron.training.checkpointing import read_tracker
    from megatron.training.data import split_documents
    from megatron.training.data_sources import open_data, write_mock_data
    from megatron.training.failsafe import SaveDirLock
    from megatron.training.preflight import check_save_dir, checkpoint_bytes
    from megatron.training.tokenizer import args_vocab_size, model_vocab_size

    try:
        vocab = args_vocab_size(args)  # reads the tokenizer files: a bad one fails here
        model_vocab_size(args)  # --padded-vocab-size must hold the tokenizer's ids
        if args.mock_data:
            write_mock_data(args, vocab)
        documents = len(open_data(args))
        if args.sb_has_predictor:  # missing / stale profile: refuse before any process group
            from megatron.training.sb_config import build_predictor

            try:
                build_predictor(args, vocab)
            except UnicodeDecodeError as e:
                raise ValueError(f"--sb-profile {args.sb_profile}: not UTF-8 text ({e.reason} at byte "
                                 f"{e.start})") from None
        fresh = args.load is not None and read_tracker(args.load) is None
        if fresh and args.exit_on_missing_checkpoint:
            raise ValueError(f"--load: no checkpoint in {args.load} (--exit-on-missing-checkpoint needs one)")
        if args.save and os.environ.get("LOCAL_RANK", "0") == "0":  # each node's view of the file system
            check_save_dir(args.save, checkpoint_bytes(args, vocab))
        if args.save and os.environ.get("RANK", "0") == "0":
            SaveDirLock(args.save).acquire()  # released at exit; a killed run's lock is stale
    except (ValueError, OSError) as e:  # OSError: a profile or dataset that cannot be read
        _fail(" ".join(str(e).split()), 2)
    for line in args.compat_warnings:
        _warn(line)
    if fresh:  # with --finetune too: Megatron-LM then starts from random weights
        also = " (--finetune has no weights to take)" if args.finetune else ""
        _warn(f"--load {args.load}: no checkpoint there; training starts from scratch{also} (as in Megatron-LM; "
              "--exit-on-missing-checkpoint makes this an error)")
    if args.eval_interval and args.eval_iters > 0 and not len(split_documents(documents, args.split_fractions)[1]):
        _warn(f"--eval-interval {args.eval_interval}: the validation split of --split {args.split} holds no "
              f"document of the {documents}; no evaluation will run")


def _is_comm_failure(e: BaseException) -> bool:
    import torch

    if isinstance(e, getattr(torch.distributed, "DistBackendError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset", "timed out", "Timed out", "gloo"))


def main(argv=None) -> int:
    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.arguments import parse_args

    args = parse_args(argv)
    _check_inputs(args)
    from megatron.training.initialize import shutdown
    from megatron.training.training import pretrain

    try:
        pretrain(args)
    except ValueError as e:
        _fail(str(e).splitlines()[0], 1)
    except Exception as e:
        if _is_comm_failure(e):
            first = str(e).strip().splitlines()[0][:300]
            _fail(f"lost contact with another rank (dead, or stuck longer than "
                  f"--distributed-timeout-minutes {args.distributed_timeout_minutes:g}): {first}", 1)
        raise
    finally:
        try:
            shutdown()
        except Exception:  # tearing down after a failed peer can itself fail; exit anyway
            pass
    return 0


if __name__ == "__main__":  # guard: megatron/torch may spawn helper processes
    sys.exit(main())
