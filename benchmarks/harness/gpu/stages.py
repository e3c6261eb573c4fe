"""gpu-check's end-to-end parts: train (dense vs sparse), profile (+ simulated comparison)
and accuracy. Each takes the parsed arguments, the seconds it may use and ``run``
(``run(cmd, timeout, env=None) -> CompletedProcess``, gpu_check's runner) and returns
``(passed, detail, data)``; ``None`` as ``passed`` means skipped."""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
import time
from typing import Callable, List, Optional, Tuple

from benchmarks.harness.gpu.proc import last_line

Result = Tuple[Optional[bool], str, dict]

TRAIN_ITERS = 9
"""The last one profiled (--profile --use-pytorch-profiler: the attention kernels' share of
the step), left out of the timing."""
TRAIN_TOPK = 8
TRAIN_QUANTILE = 0.99
"""make_corpus.py's --quantile for the training corpus: the source quantile mapped to the
micro-batch length (see gpu_check.py's --train-quantile)."""
"""Top-k at block 128 in training: (8 + 2) x 128 keys per query, ~4% of a 64K document
(more for short documents, which stay dense; the summary reports the mean)."""
LOSS_CHUNKS_FROM = 65536
"""Micro-batches of this many tokens or more run the output layer + loss fused, in chunks, in
both arms (megatron/training/linear_ce.py): at 128K the 0.5B preset's fp32 logits over 152K
words alone would fill the H200, and at 64K and 128K (Runs 6, 7) the unfused loss's fp32
passes took ~1 s of either arm's step. Shorter ones keep megatron-core's unfused loss."""
LOSS_CHUNK_TOKENS = 4096
"""--sb-loss-chunk-tokens of those runs (the driver's default; one chunk's fp32 logits 2.5 GB)."""


def loss_chunk_tokens(n: int) -> int:
    """Tokens per chunk of the output layer + loss for micro-batches of ``n`` tokens (0: unchunked)."""
    return LOSS_CHUNK_TOKENS if n >= LOSS_CHUNKS_FROM else 0


def loss_chunk_flags(n: int) -> List[str]:
    """pretrain_gpt.py's flags for :func:`loss_chunk_tokens` (Megatron-LM's linear fusion)."""
    chunk = loss_chunk_tokens(n)
    if not chunk:
        return []
    return ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear",
            "--sb-loss-chunk-tokens", str(chunk)]


def last_json(text: str) -> Optional[dict]:
    """The last JSON object printed in ``text``: one line, or an indented block that
    starts with ``{`` at the start of a line and runs to the end."""
    lines = (text or "").strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if not lines[i].startswith("{"):
            continue
        for chunk in (lines[i], "\n".join(lines[i:])):
            try:
                obj = json.loads(chunk)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def model_flags(a) -> List[str]:
    """The model of train and profile: Qwen2.5-0.5B's 24 layers on the GPU; a tiny one in
    a dry run (CPU)."""
    if a.dry_run:
        return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--ffn-hidden-size", "128", "--vocab-size", "512", "--cpu", "--hidden-dropout", "0",
                "--attention-dropout", "0"]
    return ["--model-preset", "qwen2.5-0.5b", "--bf16"]


def train_seq_lens(a) -> List[int]:
    return [1024] if a.dry_run else list(a.train_seq_lens)


def loss_trend(losses: List[float]) -> Tuple[float, float, bool]:
    """Mean of the first and last quarter of ``losses`` and whether it went down."""
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return first, last, len(losses) >= 4 and last < first


def matmul_params(preset: str = "qwen2.5-0.5b") -> int:
    """Weights of a model preset that multiply every token: each layer's q/k/v/o projections
    and (SwiGLU) MLP, and the output layer; biases, norms and the embedding lookup left
    out (Qwen2.5-0.5B: ~494M)."""
    from megatron.training.presets import MODEL_PRESETS

    m = MODEL_PRESETS[preset]
    h, f, heads, groups = m["hidden_size"], m["ffn_hidden_size"], m["num_attention_heads"], m["num_query_groups"]
    kv = 2 * h * (h // heads) * groups
    mlp = (3 if m.get("swiglu") else 2) * h * f
    return m["num_layers"] * (2 * h * h + kv + mlp) + h * m["vocab_size"]


PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0}
"""Dense bf16 tensor-core peak (SXM) of the cards gpu-check has run on."""


def matmul_mfu(tokens_per_s: Optional[float], device: Optional[str]) -> Optional[float]:
    """Model FLOPs utilisation counting the weight matmuls only: 6 x matmul params x
    tokens/s over the card's bf16 peak (attention FLOPs and recompute left out, so both
    arms are judged by the same work; a lower bound of the usual MFU). None off a known card."""
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if device and k in device), None)
    if not tokens_per_s or peak is None:
        return None
    return 6.0 * matmul_params() * tokens_per_s / (peak * 1e12)


def train_run_record(name: str, s: dict, device: Optional[str] = None) -> dict:
    """One run's row from the driver's summary JSON (``device``: the card's name, for MFU)."""
    losses = [float(x) for x in s.get("losses") or []]
    first, last, down = loss_trend(losses) if losses else (None, None, False)
    ms, tokens = s.get("step_ms_all") or [], s.get("step_tokens_all") or []
    profiled = s.get("step_profiled_all") or [False] * len(ms)
    timed = [(m, t) for m, t, p in zip(ms, tokens, profiled) if not p]
    skip = int(s.get("warmup_steps_skipped") or 0)
    per_1k = [m / t * 1e3 for m, t in timed[skip:] if t]
    prof = s.get("profile") or {}
    return {"name": name, "tokens_per_s": s.get("tokens_per_s"),
            "step_ms_all": ms, "step_tokens_all": tokens, "warmup_steps_skipped": skip,
            "ms_per_1k_tokens_median": statistics.median(per_1k) if per_1k else None,
            "flex_compiles": s.get("flex_compiles"), "routing": s.get("routing"),
            "compiles_after_step_2": s.get("kernel_compiles_after_step_2"),
            "compiles_all": s.get("kernel_compiles_all"), "compiles_by_kind": s.get("kernel_compiles_by_kind"),
            "compiles_late_by_kind": s.get("kernel_compiles_late_by_kind"), "loss_path": s.get("loss_path"),
            "peak_memory_mb_max": s.get("peak_memory_mb_max"), "step_ms_median": s.get("step_ms_median"),
            "density_mean": s.get("density_mean"), "plan_ms_median": s.get("plan_ms_median"),
            "attention_backend": s.get("attention_backend"), "dense_kernel": s.get("dense_kernel"),
            "mfu_matmul": matmul_mfu(s.get("tokens_per_s"), device),
            "attention_kernel_share": prof.get("attention_share"), "attention_kernel_ms": prof.get("attention_ms"),
            "kernel_ms": prof.get("kernel_ms"), "top_kernels": prof.get("top_kernels"),
            "kernel_classes_ms": prof.get("classes_ms"), "profile_idle_ms": prof.get("idle_ms"),
            "profile_wall_ms": prof.get("wall_ms"), "device_busy_ms": prof.get("device_busy_ms"),
            "host_sync_ms": prof.get("host_sync_ms"), "top_host_ops": prof.get("top_host_ops"), "losses": losses,
            "loss_first": first, "loss_last": last, "loss_down": down}


def train_verdict(runs: List[dict], seq_lens: List[int]) -> Result:
    """Pass when every run finished with a decreasing loss; data holds sparse/dense
    tokens/s per length (``speedup_<n>k``) and the sparse run's density."""
    data = {"runs": runs}
    for n in seq_lens:
        d = next((r for r in runs if r["name"] == f"dense {n}"), None)
        s = next((r for r in runs if r["name"] == f"sparse {n}"), None)
        if d and s and d.get("tokens_per_s") and s.get("tokens_per_s"):
            data[f"speedup_{n // 1024}k"] = s["tokens_per_s"] / d["tokens_per_s"]
            data[f"density_{n // 1024}k"] = s.get("density_mean")
        # the median step (per 1,000 tokens): what a long run converges to once every
        # shape is compiled; tokens/s above counts the steps that compiled too
        if d and s and d.get("ms_per_1k_tokens_median") and s.get("ms_per_1k_tokens_median"):
            data[f"median_step_speedup_{n // 1024}k"] = d["ms_per_1k_tokens_median"] / s["ms_per_1k_tokens_median"]
        # the target's "no compilation after step 2" (FA4, flex and the routing kernels)
        if s and s.get("compiles_after_step_2") is not None:
            data[f"compiles_after_step_2_{n // 1024}k"] = s["compiles_after_step_2"]
    bad = [r["name"] + (f": {r['error']}" if r.get("error") else ": loss did not decrease")
           for r in runs if r.get("error") or not r.get("loss_down")]
    speed = ", ".join(f"{k} {v:.2f}x" for k, v in data.items() if "speedup_" in k)
    late = ", ".join(f"{k.rsplit('_', 1)[1]} {v}" for k, v in data.items() if k.startswith("compiles_after"))
    detail = (f"{len(runs) - len(bad)}/{len(runs)} runs ok; sparse/dense tokens/s: {speed or 'n/a'}"
              + (f"; sparse compilations after step 2: {late}" if late else "")
              + (f"; failed: {'; '.join(bad)}" if bad else ""))
    return bool(runs) and not bad, detail, data


def part_train(a, left: float, run: Callable, best_backend: str) -> Result:
    """Sparse (--sparse-balance, ``best_backend``) and dense runs of the same model over the
    same corpus and steps, per micro-batch length. The dense arm's attention is the fastest
    dense varlen kernel here (FlashAttention-4's varlen call when flash-attn-4 is installed,
    else SDPA per document: :func:`sparsebalance.attention.dense.dense_backend`)."""
    work = os.path.join(a.work, "train")
    os.makedirs(work, exist_ok=True)
    t0, runs = time.time(), []
    seq_lens = train_seq_lens(a)
    # sparse first: on a lease cut short, the arm that carries the claim has run
    todo = [(n, mode) for n in seq_lens for mode in getattr(a, "train_arms", ("sparse", "dense"))]
    for i, (n, mode) in enumerate(todo):
        name = f"{mode} {n}"
        cap = (left - (time.time() - t0)) / (len(todo) - i)  # a fair share of what is left
        if cap < 30:
            runs.append({"name": name, "error": "no time left"})
            continue
        q = getattr(a, "train_quantile", TRAIN_QUANTILE)
        corpus = os.path.join(work, f"corpus_{n}_q{q}")
        if not os.path.isfile(corpus + ".idx"):
            proc = run([sys.executable, "tools/make_corpus.py", "--output-prefix", corpus, "--lengths", a.lengths,
                        "--num-docs", "200" if a.dry_run else "600", "--max-length", str(n),
                        "--quantile", str(q)], cap)
            if proc.returncode != 0:
                runs.append({"name": name, "error": "corpus: " + last_line(proc)})
                continue
        summary = os.path.join(work, f"summary_{mode}_{n}.json")
        if os.path.exists(summary):
            os.unlink(summary)
        cmd = [sys.executable, "pretrain_gpt.py", *model_flags(a), "--data-path", corpus, "--seq-length", str(n),
               "--global-batch-size", "2", "--lr", "3e-4", "--train-iters",
               str(4 if a.dry_run else TRAIN_ITERS), "--log-interval", "1", "--no-progress-bar",
               "--summary-json", summary, "--profile", "--use-pytorch-profiler"]
        last = 4 if a.dry_run else TRAIN_ITERS
        cmd += ["--profile-step-start", str(last - 1), "--profile-step-end", str(last)]
        if not a.dry_run:
            # 24 layers at 64K tokens keep ~3 GB of activations per layer: whole-layer
            # recompute in both arms (the fp32 logits over 152K words stay the big block)
            cmd += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                    "--recompute-num-layers", "1"]
        cmd += loss_chunk_flags(n)  # the same in both arms: the comparison stays fair
        if mode == "sparse":
            cmd += ["--sparse-balance", "--sb-block-size", "64" if a.dry_run else "128",
                    "--sb-topk", str(TRAIN_TOPK), "--sb-attention-backend", best_backend,
                    "--sb-cost-model", "h100-analytic"]
        proc = run(cmd, cap)
        if proc.returncode != 0 or not os.path.isfile(summary):
            runs.append({"name": name, "error": "pretrain_gpt.py: " + last_line(proc)})
            continue
        with open(summary) as fh:
            runs.append({**train_run_record(name, json.load(fh), getattr(a, "device_name", None)),
                         "corpus": {"lengths": os.path.basename(a.lengths), "quantile": q},
                         "loss_chunk_tokens": loss_chunk_tokens(n)})
    return train_verdict(runs, seq_lens)


def length_files(a) -> List[str]:
    """The document-length files of the profile and the simulated comparison: the copies gpu-prep
    put in gpudata/ (the repository's data/lengths by default) (a dry run: the prolong file
    only, the one with enough short documents)."""
    files = sorted(glob.glob(os.path.join(a.repo, "gpudata", "*.json")))
    if a.dry_run:
        files = [f for f in files if f.endswith("prolong.json")] or [
            os.path.join(a.repo, "data", "lengths", "prolong.json")]
    return files


def keep_log(a, name: str, proc) -> None:
    """A tool's stdout and stderr, kept under the work folder (the lease copies it back)."""
    from sparsebalance.io import atomic_write_text

    os.makedirs(a.work, exist_ok=True)
    atomic_write_text(os.path.join(a.work, name), f"exit {proc.returncode}\n# stdout\n{proc.stdout or ''}"
                      f"\n# stderr\n{proc.stderr or ''}")


def part_profile(a, left: float, run: Callable, best_backend: str) -> Result:
    """tools/profile_latency.py on this device for the train model (held-out MAPE), the
    profile written under --out, then benchmarks/compare.py --mode sim with it."""
    t0 = time.time()
    prof = os.path.join(a.out, "latency_profile.json")
    block = "64" if a.dry_run else "128"
    cmd = [sys.executable, "tools/profile_latency.py", "--output", prof, *model_flags(a), "--sparse-attention",
           "--seq-length", "2048" if a.dry_run else "32768", "--sb-block-size", block,
           "--sb-topk", str(TRAIN_TOPK), "--validate", "--json", "--quick"]
    cmd = [c for c in cmd if c != "--cpu"]  # the profiler picks its device itself
    if not a.dry_run:
        # 5 repeats (quick's 7 did not finish with the held-out check in 96 s on an H200)
        cmd += ["--sb-attention-backend", best_backend, "--clock", "wall", "--repeats", "5"]
    files = length_files(a)
    if files:
        cmd += ["--length-files", *files]
    proc = run(cmd, left * 0.8)  # the rest for compare.py
    keep_log(a, "profile_latency.log", proc)
    res = last_json(proc.stdout)
    # The result is printed last: a whole JSON object naming this profile means the tool
    # finished, even when its process then outlived the time limit (Runs 5-7).
    hung = proc.returncode == 124 and res is not None and res.get("output") == prof
    if (proc.returncode != 0 and not hung) or res is None or not os.path.isfile(prof):
        return False, "profile_latency.py: " + last_line(proc), {}
    data = {"profile": os.path.relpath(prof, a.repo), "mape": res.get("mape"),
            "mape_fwd": res.get("mape_fwd"), "mape_bwd": res.get("mape_bwd"),
            "stage_mape": res.get("stage_mape"), "n_heldout": res.get("n_heldout")}
    # "profile": the simulated model is the profiled one (same block and top-k)
    sim = run([sys.executable, "benchmarks/compare.py", "--mode", "sim", "--quick", "--cost-model", prof,
               "--sim-models", "profile", "--block-size", block, "--topk", str(TRAIN_TOPK), "--json",
               "--report", os.path.join(a.work, "compare_sim"),
               *(["--lengths", *files] if files else []),
               *(["--pp", "2", "--dp", "1", "--micro-batches", "8", "--seq-lengths", "16384"]
                 if a.dry_run else [])],
              left - (time.time() - t0))
    data["compare_sim"] = last_json(sim.stdout) if sim.returncode == 0 else None
    ok = sim.returncode == 0 and data["mape"] is not None
    data["exited"] = not hung
    detail = (f"held-out MAPE {data['mape']:.3f}" if data["mape"] is not None else "no MAPE") + \
        ("; profile_latency.py printed its result, then did not exit before its limit" if hung else "") + \
        ("; compare.py --mode sim ran with the profile" if sim.returncode == 0
         else "; compare.py --mode sim failed: " + last_line(sim))
    return ok, detail, data


ACCURACY_MIN_S = 1200
"""examples/longctx/gpu.sh's own estimate is ~25 minutes; it is not started with less."""


def part_accuracy(a, left: float, run: Callable, best_backend: str) -> Result:
    """examples/longctx/gpu.sh (its sparse arm resolves ``auto`` to the measured best
    backend of this device), when enough of the budget is left."""
    if a.dry_run:
        return None, "skipped in a dry run (examples/longctx/gpu.sh --tiny takes minutes)", {}
    if left < ACCURACY_MIN_S:
        return None, f"skipped: {left:.0f} s left, gpu.sh needs ~{ACCURACY_MIN_S} s", {}
    result = os.path.join(a.out, "longctx_accuracy.json")  # small: kept with the report
    proc = run(["bash", "examples/longctx/gpu.sh"], left, env={"RESULT_FILE": result})
    if proc.returncode != 0 or not os.path.isfile(result):
        return False, "gpu.sh: " + last_line(proc), {}
    with open(result) as fh:
        return True, f"wrote {os.path.relpath(result, a.repo)}", {"result": json.load(fh)}
