#!/usr/bin/env python
"""Profile one transformer layer (+ stage extras) and fit the latency predictor.

Times the forward and the backward of ONE megatron-core transformer layer (our
layer spec: dense causal varlen attention, or block top-k sparse attention with
``--sparse-attention``) on packed THD micro-batches over a grid of compositions
(single long documents, many short ones, mixes resampled from
data/lengths/*.json, or your own) and budgets, plus the per-stage extras (embedding;
final norm + output layer + loss). Medians of repeats after warm-up, at a fixed
thread count. Writes a profile JSON (hardware + model fingerprints, raw samples,
fitted coefficients) that ``sparsebalance.predictor.get_predictor(path)`` loads.

``--validate`` also measures held-out random micro-batches that are not in the
grid and, for a few of them, a whole pipeline stage (embedding / layers / output
+ loss), and reports the prediction error as JSON (``--json``). Grid, held-out
and stage items are timed in interleaved rounds (see :func:`_measure`).

Clock: on a CPU shared with other jobs, elapsed time mostly measures the other
jobs; ``--clock cpu`` (the default on CPU with one thread) times this process's
CPU time instead. With several threads only ``--clock wall`` is meaningful, and
only on an otherwise idle machine.

Tiny CPU run (under a minute)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/profile_latency.py --quick --validate --json \
        --sparse-attention --seq-length 2048 --hidden-size 128 --num-attention-heads 4 \
        --sb-block-size 64 --sb-topk 8

Write a profile for the CPU demo model (the training run must use the same threads)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/profile_latency.py --output results/latency_profile.json \
        --sparse-attention --seq-length 2048 --hidden-size 128 --num-attention-heads 4 \
        --sb-block-size 64 --sb-topk 8

GPU cluster (one GPU of the target node; same model flags as the training job)::

    python tools/profile_latency.py --output profiles/qwen05b_h100.json --sparse-attention \\
        --num-layers 24 --hidden-size 896 --num-attention-heads 14 --num-query-groups 2 \\
        --ffn-hidden-size 4864 --swiglu --vocab-size 151936 --seq-length 32768 \\
        --sb-block-size 256 --sb-topk 32 --bf16
"""

from __future__ import annotations

import glob
import os
import shlex
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

_LENGTH_FILES = os.path.join(_REPO, "data", "lengths", "*.json")


def build_parser():
    """This tool's flags, listed first in ``--help``, then pretrain_gpt.py's (the model's)."""
    from megatron.training.arguments import build_parser as megatron_parser

    return megatron_parser(prog="profile_latency.py", description=__doc__.split("\n")[0], own_flags=_own_flags)


def _own_flags(p) -> None:
    g = p.add_argument_group("profile_latency")
    g.add_argument("--output", default=None, help="profile JSON to write (atomic)")
    g.add_argument("--quick", action="store_true", help="small grid and held-out set (< 1 min)")
    g.add_argument("--validate", action="store_true",
                   help="measure held-out micro-batches and whole stages; report errors")
    g.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    g.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $OMP_NUM_THREADS, else 1)")
    g.add_argument("--repeats", type=int, default=None, help="timed repetitions (default 9; quick 7)")
    g.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing")
    g.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="wall: elapsed time (dedicated machines, GPUs); cpu: this process's CPU "
                        "time, robust to other jobs on a shared CPU, meaningful with one thread; "
                        "auto: cpu on CPU with one thread, wall otherwise")
    g.add_argument("--budgets", type=int, nargs="*", default=None,
                   help="top-k values to profile (default: around --sb-topk, plus dense)")
    g.add_argument("--heldout", type=int, default=None, help="held-out micro-batches (default 40; quick 12)")
    g.add_argument("--stage-checks", type=int, default=None,
                   help="held-out micro-batches timed as whole stages (default 6; quick 3)")
    g.add_argument("--length-files", "--lengths", nargs="*", default=None,
                   help="JSON lists of document lengths, e.g. your corpus' from tools/dataset_lengths.py "
                        "(default data/lengths/*.json)")
    g.add_argument("--length-scale", type=float, default=None,
                   help="multiplier on resampled lengths (default seq-length / 32768)")
    g.add_argument("--profile-seed", type=int, default=0, help="seed of the grid and held-out set")


def check_args(args, parser) -> None:
    """Usage errors -> one line, exit 2."""
    from megatron.training.arguments import usage_error

    prog = parser.prog
    if not args.validate and not args.output:
        usage_error("--output is required unless --validate is given", prog)
    if args.seq_length < 2 * args.sb_block_size:
        usage_error(f"--seq-length {args.seq_length} must be at least 2 x --sb-block-size", prog)
    for name in ("repeats", "heldout", "stage_checks", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            usage_error(f"--{name.replace('_', '-')} must be >= 1, got {v}", prog)
    if args.warmup < 0:
        usage_error(f"--warmup must be >= 0, got {args.warmup}", prog)
    if args.budgets is not None and any(k < 0 for k in args.budgets):
        usage_error("--budgets must be >= 0", prog)
    if args.hidden_size % args.num_attention_heads:
        usage_error(f"--hidden-size {args.hidden_size} not divisible by --num-attention-heads "
                    f"{args.num_attention_heads}", prog)
    groups = args.num_query_groups or args.num_attention_heads
    if args.num_attention_heads % groups:
        usage_error("--num-attention-heads must be a multiple of --num-query-groups", prog)
    if args.num_layers % args.pipeline_model_parallel_size:
        usage_error(f"--num-layers {args.num_layers} is not divisible by "
                    f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}", prog)
    cuda = __import__("torch").cuda.is_available() and not args.cpu
    if args.bf16 and not cuda:
        usage_error("--bf16 needs a GPU", prog)
    if args.clock == "cpu" and cuda:
        usage_error("--clock cpu measures host CPU time; GPU kernels need --clock wall", prog)
    files = args.length_files if args.length_files is not None else sorted(glob.glob(_LENGTH_FILES))
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        usage_error(f"length files not found: {missing or _LENGTH_FILES}", prog)
    args.length_files = files
    from sparsebalance.predictor.grid import load_length_pool

    try:
        args.length_pool = load_length_pool(files)
    except ValueError as e:
        usage_error(str(e), prog)
    if args.sparse_attention:
        from sparsebalance.ops import BACKENDS

        if args.sb_attention_backend != "auto" and args.sb_attention_backend not in BACKENDS:
            usage_error(f"--sb-attention-backend must be 'auto' or one of {sorted(BACKENDS)}, "
                        f"got {args.sb_attention_backend!r}", prog)
    if args.output and os.path.isdir(args.output):
        usage_error(f"--output {args.output} is a directory", prog)
    if args.length_scale is not None and not args.length_scale > 0:
        usage_error(f"--length-scale must be > 0, got {args.length_scale}", prog)


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median(xs) -> float:
    import statistics

    return float(statistics.median(xs))


class Bench:
    """One transformer layer, the embedding, and final norm + output layer + loss of
    the model the flags describe, built from megatron-core's own modules."""

    def __init__(self, args):
        import atexit
        import gc
        import shutil
        import tempfile

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        self._store = None
        if not dist.is_initialized():
            self._store = tempfile.mkdtemp(prefix="profile_latency-")
            # Removed at exit even when building the model below fails.
            atexit.register(shutil.rmtree, self._store, ignore_errors=True)
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    init_method=f"file://{self._store}/pg", world_size=1, rank=0)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel()
        self.dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.cfg = cfg = TransformerConfig(
            num_layers=1, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
            gated_linear_unit=args.swiglu, activation_func=_activation(args.swiglu),
            normalization=args.normalization, use_cpu_initialization=True,  # then .to(device)
            params_dtype=self.dtype, bf16=args.bf16, hidden_dropout=0.0, attention_dropout=0.0,
            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False)
        spec = _layer_spec(args)
        self.vocab = args.vocab_size
        self._clock = time.process_time if args.clock == "cpu" else time.perf_counter
        make_layer = lambda n: build_module(spec, config=cfg, layer_number=n).to(self.device)
        self.layers = [make_layer(1)]
        self._make_layer = make_layer
        self.embedding = LanguageModelEmbedding(cfg, self.vocab, args.seq_length, "rope").to(self.device)
        self.final_norm = build_module(spec.submodules.input_layernorm, config=cfg,
                                       hidden_size=cfg.hidden_size,
                                       eps=cfg.layernorm_epsilon).to(self.device)
        self.output = tensor_parallel.ColumnParallelLinear(
            cfg.hidden_size, self.vocab, config=cfg, init_method=cfg.init_method, bias=False,
            gather_output=False).to(self.device)
        self._xent = tensor_parallel.vocab_parallel_cross_entropy
        # The RoPE table megatron's RotaryEmbedding builds (base 10000), made here because
        # RotaryEmbedding moves its buffer to torch.cuda.current_device() on every call.
        head_dim = cfg.kv_channels
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self._inv_freq = inv.to(self.device)
        # Freeze the (large) megatron/torch object graph so the collection before each
        # timed call only walks young objects (a full collection here costs ~0.2 s).
        gc.collect()
        gc.freeze()

    def close(self) -> None:
        """Undo the gc.freeze() of __init__ (frozen objects would outlive shutdown), and end
        the process group this profiler started: a live NCCL group left to the interpreter's
        exit can hold the process up after its result is printed (Runs 5-7 on an H200: the
        profile was written, then the tool was cut at its time limit)."""
        import gc

        import torch.distributed as dist

        gc.unfreeze()
        if self._store is not None and dist.is_initialized():
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            dist.destroy_process_group()

    # -- inputs ------------------------------------------------------------------
    def _packed(self, lengths):
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        cu = cu.to(self.device)
        m = max(lengths)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                              max_seqlen_q=m, max_seqlen_kv=m)
        # RoPE table [max_len, 1, 1, head_dim]; megatron applies it per document in THD.
        freqs = torch.outer(torch.arange(m, device=self.device, dtype=torch.float32), self._inv_freq)
        rope = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        pos = torch.cat([torch.arange(L, device=self.device) for L in lengths])
        return psp, rope, pos

    def _budgeted(self, psp, topk):
        """``psp`` carrying the budget of the timed call. The sparse layer is built with a
        static budget of None, so a None budget runs its dense path, as in training."""
        from sparsebalance.attention.packed import BudgetedPackedSeqParams

        return BudgetedPackedSeqParams(**vars(psp), budget=topk)

    def _layer_stack(self, n):
        while len(self.layers) < n:
            self.layers.append(self._make_layer(len(self.layers) + 1))
        return self.layers[:n]

    # -- timing ---------------------------------------------------------------------
    def _run(self, fwd):
        """Time ``fwd()`` and the backward of its result once; returns (fwd_ms, bwd_ms).
        The garbage collector is off while timing (a collection is not the model's cost)."""
        import gc

        gc.collect()
        gc.disable()
        try:
            _sync()
            t0 = self._clock()
            out, grad = fwd()
            _sync()
            t1 = self._clock()
            out.backward(grad)
            _sync()
            t2 = self._clock()
            del out, grad
        finally:
            gc.enable()
        for m in (*self.layers, self.embedding, self.final_norm, self.output):
            m.zero_grad(set_to_none=True)
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    def time_stage(self, lengths, topk, n_layers, first, last):
        """Forward/backward ms of embedding? + n_layers layers + (norm, output, loss)?."""
        import torch

        T = int(sum(lengths))
        psp, rope, pos = self._packed(lengths)
        psp = self._budgeted(psp, topk)
        layers = self._layer_stack(n_layers)
        ids = torch.randint(0, self.vocab, (1, T), device=self.device)
        labels = torch.randint(0, self.vocab, (1, T), device=self.device)
        x0 = torch.randn(T, 1, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
        gout = torch.ones_like(x0)  # made outside the timed region

        def fwd():
            if first:
                h = self.embedding(input_ids=ids, position_ids=pos[None])
            else:
                h = x0.detach().requires_grad_(True)
            for layer in layers:
                h = layer(h, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=psp)
                h = h[0] if isinstance(h, tuple) else h
            if last:
                logits, _ = self.output(self.final_norm(h))
                loss = self._xent(logits.float(), labels.t()).sum() / T
                return loss, None
            return h, gout

        return self._run(fwd)

    def time_extra(self, kind, tokens):
        """Embedding alone, or final norm + output layer + loss alone, for ``tokens``."""
        import torch

        T = int(tokens)
        if kind == "embedding":
            ids = torch.randint(0, self.vocab, (1, T), device=self.device)
            pos = torch.arange(T, device=self.device)[None]
            gout = torch.ones(T, 1, self.cfg.hidden_size, device=self.device, dtype=self.dtype)

            def fwd():
                return self.embedding(input_ids=ids, position_ids=pos), gout
        else:
            x0 = torch.randn(T, 1, self.cfg.hidden_size, device=self.device, dtype=self.dtype)
            labels = torch.randint(0, self.vocab, (1, T), device=self.device)

            def fwd():
                logits, _ = self.output(self.final_norm(x0.detach().requires_grad_(True)))
                return self._xent(logits.float(), labels.t()).sum() / T, None
        return self._run(fwd)


def _activation(swiglu: bool):
    import torch.nn.functional as F

    return F.silu if swiglu else F.gelu


def _layer_spec(args):
    """Our layer spec: sparse attention with --sparse-attention, dense otherwise.

    The sparse layer's static budget is None: every timed call sets its budget through
    packed params (None = the dense path)."""
    from sparsebalance.attention.spec import get_gpt_layer_dense_spec

    if not args.sparse_attention:
        return get_gpt_layer_dense_spec(normalization=args.normalization)
    from sparsebalance.attention.sparse import get_gpt_layer_sparse_spec

    return get_gpt_layer_sparse_spec(block_size=args.sb_block_size, topk=None,
                                     backend=args.sb_attention_backend,
                                     normalization=args.normalization)


def model_fingerprint(args) -> dict:
    """Everything about the model a layer's time depends on (see predictor.profile)."""
    from sparsebalance.predictor import ModelShape

    shape = ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads,
                       num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
                       vocab_size=args.vocab_size, swiglu=bool(args.swiglu),
                       block_size=args.sb_block_size, topk=args.sb_topk)
    backend = "sdpa"
    if args.sparse_attention:  # record the kernel "auto" resolves to, not "auto"
        import torch

        from sparsebalance.ops import resolve_backend

        cuda = torch.cuda.is_available() and not args.cpu
        backend = resolve_backend(args.sb_attention_backend, torch.device("cuda" if cuda else "cpu"))
    return {**shape.as_dict(), "attention": "sparse" if args.sparse_attention else "dense",
            "attention_backend": backend,
            "normalization": args.normalization, "seq_length": args.seq_length,
            "params_dtype": "bf16" if args.bf16 else "fp32"}


def _fill_defaults(args) -> None:
    """Derived model fields, as pretrain_gpt.py derives them."""
    from megatron.training.arguments import derive_model_fields
    from megatron.training.tokenizer import vocab_size_for

    derive_model_fields(args)
    args.num_query_groups = args.num_query_groups or args.num_attention_heads
    args.vocab_size = vocab_size_for(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    args.repeats = args.repeats or (7 if args.quick else 9)
    args.heldout = args.heldout or (12 if args.quick else 40)
    args.stage_checks = args.stage_checks or (3 if args.quick else 6)
    k = args.sb_topk
    if args.budgets is None:
        if args.sparse_attention:
            ks = {max(1, k // 2), k} if args.quick else {max(1, k // 4), max(1, k // 2), k, 2 * k}
            args.budgets = (*sorted(ks), None)
        else:
            args.budgets = (None,)
    else:
        args.budgets = tuple(args.budgets) or (None,)


def _measure(bench, items, args, desc):
    """Median fwd/bwd ms of every item, timed in interleaved rounds.

    Items are ``(kind, lengths, topk, stage)`` with kind "layer", "embedding",
    "output" (lengths = [tokens]) or "stage" (a whole pipeline stage). Each round
    times every item once, in a fresh random order; the first ``--warmup`` rounds
    are discarded. Interleaving spreads the slow drift of a shared machine evenly
    over all items (grid and held-out alike) instead of letting it bias whichever
    items happened to run during a busy minute.

    Returns:
        list of (fwd_ms_list, bwd_ms_list), aligned with ``items``.
    """
    import numpy as np
    from tqdm import tqdm

    rng = np.random.default_rng(args.profile_seed + 1)
    pp = args.pipeline_model_parallel_size
    out = [([], []) for _ in items]
    rounds = args.warmup + args.repeats
    with tqdm(total=rounds * len(items), desc=desc, file=sys.stderr, leave=False,
              disable=None) as bar:
        for r in range(rounds):
            for i in rng.permutation(len(items)):
                kind, lengths, topk, stage = items[i]
                if kind == "layer":
                    f, b = bench.time_stage(lengths, topk, 1, False, False)
                elif kind == "stage":
                    f, b = bench.time_stage(lengths, topk, args.num_layers // pp,
                                            stage == 0, stage == pp - 1)
                else:
                    f, b = bench.time_extra(kind, lengths[0])
                if r >= args.warmup:
                    out[i][0].append(f)
                    out[i][1].append(b)
                bar.update()
    return out


def _samples(items, times):
    """Profile samples (JSON-ready) of measured items."""
    samples = []
    for (kind, lengths, topk, _), (f, b) in zip(items, times):
        for phase, reps in (("fwd", f), ("bwd", b)):
            samples.append({"kind": kind, "phase": phase, "lengths": [int(x) for x in lengths],
                            "topk": topk, "ms": _median(reps),
                            "repeats_ms": [round(x, 4) for x in reps]})
    return samples


def _report(predictor, held, held_times, stage_items, stage_times, args) -> dict:
    """Held-out layer error and whole-stage error of ``predictor`` (JSON-ready)."""
    import numpy as np

    from sparsebalance.predictor.fitting import mape, spearman

    meas = {p: np.array([_median(t[i]) for t in held_times]) for i, p in enumerate(("fwd", "bwd"))}
    pred = {p: np.array([predictor.layer_ms(L, t, p) for _, L, t, _ in held]) for p in ("fwd", "bwd")}
    tot_m, tot_p = meas["fwd"] + meas["bwd"], pred["fwd"] + pred["bwd"]
    # Spread of the repeats themselves (median over items of MAD / median of the
    # fwd+bwd repeats): the floor below which no model's held-out error can go.
    noise = [np.median(np.abs(r - np.median(r))) / np.median(r)
             for r in (np.add(f, b) for f, b in held_times)]
    out = {"n_heldout": len(held), "repeat_noise": float(np.median(noise)), "mape_fwd": mape(pred["fwd"], meas["fwd"]),
           "mape_bwd": mape(pred["bwd"], meas["bwd"]), "mape": mape(tot_p, tot_m),
           "max_ape": float(np.max(np.abs(tot_p - tot_m) / tot_m)),
           "spearman": spearman(tot_p, tot_m),
           "heldout": [{"docs": len(L), "tokens": int(sum(L)), "max_len": int(max(L)), "topk": t,
                        "measured_ms": round(float(mt), 3), "predicted_ms": round(float(pt), 3)}
                       for (_, L, t, _), mt, pt in zip(held, tot_m, tot_p)]}
    pp = args.pipeline_model_parallel_size
    rows = []
    for (_, L, t, stage), (f, b) in zip(stage_items, stage_times):
        m = _median(f) + _median(b)
        p = sum(predictor.stage_ms(L, t, stage, pp, ph) for ph in ("fwd", "bwd"))
        rows.append({"stage": stage, "docs": len(L), "tokens": int(sum(L)), "topk": t,
                     "measured_ms": round(m, 3), "predicted_ms": round(p, 3),
                     "error": round(p / m - 1, 4)})
    if rows:
        errs = np.array([abs(r["error"]) for r in rows])
        out.update({"stage_mape": float(errs.mean()), "stage_max_err": float(errs.max()),
                    "stage_pp": pp, "stage_layers": args.num_layers // pp, "stages": rows})
    return out


def run(args, threads: int, command: str, t0: float) -> int:
    """Profile (and validate); prints a summary or JSON; returns the exit code."""
    import json

    import numpy as np

    from sparsebalance.predictor import ModelShape
    from sparsebalance.predictor.fitted import FittedPredictor
    from sparsebalance.predictor.grid import GridSpec, heldout_set, training_grid
    from sparsebalance.predictor.profile import hardware_fingerprint, make_profile, save_profile

    _fill_defaults(args)
    rng = np.random.default_rng(args.profile_seed)
    pool = args.length_pool
    spec = GridSpec(capacity=args.seq_length, block_size=args.sb_block_size,
                    budgets=args.budgets, length_scale=args.length_scale)
    grid = training_grid(pool, spec, rng, n_mixes=4 if args.quick else 16,
                         fractions=(1.0, 0.5, 0.25) if args.quick else (1.0, 0.75, 0.5, 0.25, 0.125))
    C = args.seq_length
    token_counts = sorted({C, C // 2, C // 4} if args.quick else {C, C // 2, C // 4, C // 8})
    items = [("layer", L, t, None) for L, t in grid]
    items += [(kind, [n], None, None) for kind in ("embedding", "output") for n in token_counts]
    held, stage_items = [], []
    if args.validate:
        k, pp = args.sb_topk, args.pipeline_model_parallel_size
        held = [("layer", L, t, None) for L, t in heldout_set(
            pool, spec, rng, args.heldout, (max(0, k // 4), 2 * k),
            dense_share=0.15 if args.sparse_attention else 1.0)]
        stage_items = [("stage", L, t, s) for _, L, t, _ in held[: args.stage_checks]
                       for s in sorted({0, pp - 1})]
    bench = Bench(args)
    try:
        times = _measure(bench, items + held + stage_items, args, "profile")
    finally:
        bench.close()
    n, m = len(items), len(held)
    samples = _samples(items, times[:n])
    model = model_fingerprint(args)
    timing = {"clock": args.clock, "statistic": "median", "repeats": args.repeats,
              "warmup": args.warmup, "order": "interleaved rounds"}
    profile = make_profile(hardware_fingerprint(threads), model, samples, command, timing)
    if args.output:
        save_profile(args.output, profile)
    result = {"output": args.output, "threads": threads, "n_samples": len(samples),
              "budgets": list(args.budgets), "coefficients": profile["coefficients"],
              "hardware": profile["hardware"], "timing": timing, "command": command}
    if args.validate:
        shape = ModelShape(**{k: model[k] for k in ModelShape.__dataclass_fields__})
        pred = FittedPredictor(shape, profile["coefficients"],
                               dense_only=not args.sparse_attention)
        result.update(_report(pred, held, times[n:n + m], stage_items, times[n + m:], args))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(result, indent=1), flush=True)
    else:
        print(f"profile_latency: {len(samples)} samples in {result['seconds']} s, threads={threads}"
              + (f" -> {args.output}" if args.output else ""))
        for key in ("mape_fwd", "mape_bwd", "mape", "spearman", "stage_mape", "stage_max_err",
                    "repeat_noise"):
            if key in result:
                print(f"  {key} = {result[key]:.4f}")
    return 0


def main(argv=None) -> int:
    t0 = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    # Fix the thread count before torch is imported (OpenMP reads it once).
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 1)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    check_args(args, parser)
    import torch

    torch.set_num_threads(threads)
    if args.clock == "auto":
        on_cpu = args.cpu or not torch.cuda.is_available()
        args.clock = "cpu" if on_cpu and threads == 1 else "wall"
    command = " ".join(shlex.quote(a) for a in [f"OMP_NUM_THREADS={threads}", "python",
                                                "tools/profile_latency.py", *(argv or sys.argv[1:])])
    print(f"profile_latency: threads={threads} clock={args.clock} torch={torch.__version__}",
          file=sys.stderr, flush=True)
    try:
        return run(args, threads, command, t0)
    except ValueError as e:  # bad input discovered while building (shapes, files)
        from megatron.training.arguments import usage_error

        usage_error(str(e), parser.prog)

if __name__ == "__main__":
    sys.exit(main())
