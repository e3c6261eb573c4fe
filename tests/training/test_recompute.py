"""Activation recomputation (``--recompute-granularity``) with sparse attention and DST.

Training runs (PP=2 over gloo, fp32, ``--sparse-balance`` with the analytic cost model,
so every micro-batch gets its own DST budget per stage): full/uniform, full/block and
selective recompute give the losses, grad norms, last-step gradients and final
parameters of the run without recompute (1e-5 relative), both under 1F1B and under
the interleaved schedule. Each recomputed attention call must route with the budget
its original forward used, although under PP other micro-batches' forwards ran in
between; a run whose recomputation uses the latest forward's budget instead (what a
per-process budget would hold) must NOT match (so the budgets really differ where
it matters), and recomputed calls are not recorded twice.

Memory: with full recompute the activation memory of an 8-layer model is at most a
third of the memory without it. The test measures a small model at 4K tokens; the
issue's 32K-token measurement is this file as a script (about a minute on 2 cores)::

    .venv/bin/python tests/training/test_recompute.py memory --tokens 32768

It runs one fresh single-rank process per configuration (none, full/uniform/1,
selective) and prints, for each, the peak bytes of tensors saved for backward and the
peak-RSS growth around one forward+backward (see :func:`_measure`).

The file is also the torchrun worker of the training runs (``worker`` mode).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402
from tests.training._saved_bytes import SavedBytes  # noqa: E402

LAYERS, PP, M, STEPS = 4, 2, 4, 3
FLAGS = [*PROJECT_RUN_FLAGS, "--num-layers", str(LAYERS), "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "512", "--global-batch-size", str(M),
         "--lr", "1e-3", "--no-progress-bar", "--seed", "3", "--train-iters", str(STEPS),
         "--pipeline-model-parallel-size", str(PP), "--lr-decay-style", "constant",
         # as in test_dst_budgets.py: documents longer than (4 + 2) x 32 tokens are sparse,
         # so each micro-batch's budget changes its routing
         "--sparse-balance", "--sb-block-size", "32", "--sb-topk", "4",
         "--sb-cost-model", "h100-analytic",
         # budget may move between stages: every rank's micro-batches get different budgets
         # (with the per-stage floor a 2-stage, 4-micro-batch step often leaves one stage at k0)
         "--sb-dst-floor", "total"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]
RECOMPUTE = {
    "none": [],
    "full_uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "2"],
    "full_block": ["--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
    "vpp_none": VPP,
    "vpp_full_uniform": [*VPP, "--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"],
}
RTOL = 1e-5

# ----------------------------------------------------------------------------- worker


def _worker(argv) -> None:
    """torchrun worker: pretrain(argv) and dump per rank what the tests compare.

    ``$SB_TEST_DUMP/rank<r>.json``: summary, and per step the budget table, the
    attention records and every SparseAttention call (layer, micro-batch, top-k,
    recomputed?); ``rank<r>.npz``: final parameters and last-step gradients by global
    name. ``SB_TEST_NO_CAPTURE=1`` makes the module ignore the budget that the packed
    params carry (the negative control).
    """
    sys.path.insert(0, ROOT)
    import numpy as np
    import torch

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.core import parallel_state as ps

    import sparsebalance.attention.sparse as S
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import shutdown
    from megatron.training.model import global_param_names
    from megatron.training.training import pretrain

    if os.environ.get("SB_TEST_NO_CAPTURE") == "1":
        # a recomputed call gets the budget of the latest original forward on this rank
        # (what one per-process budget holds at backward time), not its own
        carried, latest = S.SparseAttention.budget_of, {}

        def stale(self, packed_seq_params):
            if S._recomputing():
                return latest["budget"]
            latest["budget"] = carried(self, packed_seq_params)
            return latest["budget"]

        S.SparseAttention.budget_of = stale
    calls, steps, tensors = [], [], {}
    attend = S.SparseAttention._attend

    def logged(self, q, k, v, cu, packed_seq_params=None):
        topk, microbatch = self.budget_of(packed_seq_params)
        calls.append([self.layer_number, microbatch, topk, S._recomputing()])
        return attend(self, q, k, v, cu, packed_seq_params)

    S.SparseAttention._attend = logged

    def on_step(iteration, state, result):
        steps.append({"budget": None if result.budget is None else np.asarray(result.budget).tolist(),
                      "records": [[r.layer_number, r.microbatch, r.topk] for r in result.attention_records],
                      "calls": list(calls)})
        calls.clear()
        tensors.clear()  # the last step's gradients and the parameters after its update
        for chunk in state.model:
            for name, p in global_param_names(chunk).items():
                tensors["grad/" + name] = p.main_grad.detach().double().numpy().copy()
                tensors["param/" + name] = p.detach().double().numpy().copy()

    summary = pretrain(parse_args(argv), on_step=on_step)
    rank, dump = torch.distributed.get_rank(), os.environ["SB_TEST_DUMP"]
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pp_rank": ps.get_pipeline_model_parallel_rank(), "steps": steps,
                   "summary": summary}, f)
    np.savez(os.path.join(dump, f"rank{rank}.npz"), **tensors)
    shutdown()


# ----------------------------------------------------------------------------- memory

MEMORY_MODEL = [*PROJECT_RUN_FLAGS, "--num-layers", "8", "--hidden-size", "128", "--ffn-hidden-size", "512",
                "--num-attention-heads", "4", "--sparse-attention", "--sb-block-size", "64",
                "--sb-topk", "8", "--cpu", "--seed", "1"]
MEMORY_CONFIGS = {"none": [], "full": ["--recompute-granularity", "full", "--recompute-method",
                                       "uniform", "--recompute-num-layers", "1"],
                  "selective": ["--recompute-granularity", "selective"]}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _measure(argv) -> dict:
    """One forward+backward of the GPT of ``argv`` (pretrain_gpt.py flags plus
    ``--tokens T --docs D``) on one packed micro-batch of T tokens in D documents.

    Returns the peak MB of tensors saved for backward (:class:`SavedBytes`) and at the
    end of the forward, and the growth of this process's peak RSS over its RSS just
    before the forward (``ru_maxrss``). The RSS growth also holds the parameter gradients
    (the same in every configuration) and transient buffers, so it exceeds the saved
    bytes. Run it in a fresh process: ``ru_maxrss`` never goes down.
    """
    import argparse
    import resource
    import tempfile

    import numpy as np
    import torch

    sys.path.insert(0, ROOT)
    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training import initialize as init
    from megatron.training import model as M
    from megatron.training.arguments import parse_args
    from megatron.training.indexed_io import write_documents
    from megatron.training.tokenizer import padded_vocab_size, vocab_size_for
    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    own = argparse.ArgumentParser(prog="test_recompute.py measure")
    own.add_argument("--tokens", type=int, required=True)
    own.add_argument("--docs", type=int, default=1)
    own, rest = own.parse_known_args(argv)
    tokens, docs = own.tokens, own.docs
    with tempfile.TemporaryDirectory() as d:  # the flags need a dataset; the data is made below
        write_documents(f"{d}/c", [np.ones(8, dtype=np.int64)], 256)
        args = parse_args([*rest, "--seq-length", str(tokens), "--data-path", f"{d}/c"])
    init.initialize(args)
    vocab = padded_vocab_size(vocab_size_for(args.tokenizer_type, args.tokenizer_model, args.vocab_size),
                              args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    model = M.build_gpt_chunks(args, M.transformer_config(args, use_cpu=True), vocab)[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens + 1), generator=g)
    bounds = [tokens * i // docs for i in range(docs + 1)]
    cu = torch.tensor(bounds, dtype=torch.int32)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])]).unsqueeze(0)
    packed = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(np.diff(bounds)), max_seqlen_kv=max(np.diff(bounds)))
    counter = SavedBytes(model.parameters())
    rss0, maxrss0 = _rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:], packed_seq_params=packed).mean()
        after_forward = counter.live
        loss.backward()
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    init.shutdown()
    return {"tokens": tokens, "layers": args.num_layers, "recompute": args.recompute_granularity,
            "saved_peak_mb": counter.peak / 2**20, "saved_after_forward_mb": after_forward / 2**20,
            # False: the process peaked higher before the forward (then growth is a lower bound)
            "rss_growth_mb": maxrss - rss0, "rss_peak_in_step": maxrss > maxrss0,
            "saved_left_mb": counter.live / 2**20}


def measure_configs(tokens: int, docs: int = 1, configs=("none", "full"), model=MEMORY_MODEL,
                    side_by_side: int = 1) -> dict:
    """:func:`_measure` of each recompute config, each in a fresh process (1 thread),
    ``side_by_side`` of them at a time (each process measures only itself).

    ``MALLOC_MMAP_THRESHOLD_`` makes glibc hand every allocation above 128 KiB back to
    the system when freed, so the peak RSS follows the live tensors instead of what
    malloc's arenas kept from earlier ones.
    """
    from concurrent.futures import ThreadPoolExecutor

    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072", PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)

    def measure(name):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__),
                               "measure", *model, *MEMORY_CONFIGS[name], "--tokens", str(tokens),
                               "--docs", str(docs)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=side_by_side) as pool:
        return dict(zip(configs, pool.map(measure, configs)))


def _memory_main(argv) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="test_recompute.py memory",
                                description="activation memory with and without recompute")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--configs", default="none,full,selective")
    a = p.parse_args(argv)
    res = measure_configs(a.tokens, a.docs, a.configs.split(","))
    base = res.get("none")
    for name, r in res.items():
        ratio = f"{r['saved_peak_mb'] / base['saved_peak_mb']:.3f}" if base else "-"
        rss = f"{r['rss_growth_mb'] / base['rss_growth_mb']:.3f}" if base else "-"
        print(f"{name:10s} saved-for-backward peak {r['saved_peak_mb']:8.1f} MB (x{ratio} of none) | "
              f"after forward {r['saved_after_forward_mb']:8.1f} MB | peak RSS growth "
              f"{r['rss_growth_mb']:8.1f} MB (x{rss})")
    print(json.dumps(res))


# ----------------------------------------------------------------------------- tests

if __name__ != "__main__":
    import numpy as np
    import pytest

    _RUNS: dict = {}
    """Runs by (name, no_capture), each launched once per session and shared by the tests."""

    def _run(name, corpus, tmp_path_factory, world, no_capture=False):
        key = (name, no_capture)
        if key not in _RUNS:
            dump = str(tmp_path_factory.mktemp(name))
            extra = {"SB_TEST_DUMP": dump, "SB_TEST_NO_CAPTURE": "1" if no_capture else "0"}
            proc = world.launch(os.path.abspath(__file__),
                          ["worker", *FLAGS, *RECOMPUTE[name], "--data-path", corpus], nproc=2, extra_env=extra)
            assert proc.returncode == 0, proc.stderr[-3000:]
            ranks = [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)]
            arrays = {}
            for r in range(2):
                arrays.update(dict(np.load(os.path.join(dump, f"rank{r}.npz"))))
            _RUNS[key] = {"ranks": ranks, "arrays": arrays, "summary": ranks[0]["summary"]}
        return _RUNS[key]

    def _rel(a, b) -> float:
        return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-30))

    def _assert_same_training(run, base):
        s, b = run["summary"], base["summary"]
        assert _rel(s["losses"], b["losses"]) <= RTOL, (s["losses"], b["losses"])
        assert _rel(s["grad_norms"], b["grad_norms"]) <= RTOL, (s["grad_norms"], b["grad_norms"])
        assert sorted(run["arrays"]) == sorted(base["arrays"])
        worst = max(((_rel(run["arrays"][k], base["arrays"][k]), k) for k in base["arrays"]))
        assert worst[0] <= RTOL, worst

    @pytest.mark.parametrize("name,base", [("full_uniform", "none"), ("full_block", "none"),
                                           ("selective", "none"), ("vpp_full_uniform", "vpp_none")])
    def test_recompute_matches_no_recompute(name, base, long_corpus, tmp_path_factory, world):
        ref = _run(base, long_corpus, tmp_path_factory, world)
        run = _run(name, long_corpus, tmp_path_factory, world)
        _assert_same_training(run, ref)
        # a recomputed forward is not a new attention call: records and density as without
        for r, rr in zip(run["ranks"], ref["ranks"]):
            assert [s["records"] for s in r["steps"]] == [s["records"] for s in rr["steps"]]
        assert run["summary"]["density_mean"] == ref["summary"]["density_mean"]
        assert run["summary"]["args"]["recompute_granularity"] == RECOMPUTE[name][RECOMPUTE[name].index(
            "--recompute-granularity") + 1]

    def _expected_recomputed(name, pp_rank):
        """Layers whose attention a recompute mode re-runs on this pipeline rank."""
        if name == "full_block":  # the first layer of the rank's chunk
            return {1 + pp_rank * LAYERS // PP}
        per_stage = 1 if name.startswith("vpp") else LAYERS // PP
        return {layer for layer in range(1, LAYERS + 1) if ((layer - 1) // per_stage) % PP == pp_rank}

    @pytest.mark.parametrize("name", ["full_uniform", "full_block", "selective", "vpp_full_uniform"])
    def test_recomputed_attention_uses_its_microbatch_budget(name, long_corpus, tmp_path_factory, world):
        run = _run(name, long_corpus, tmp_path_factory, world)
        for rank in run["ranks"]:
            for step in rank["steps"]:
                first = {}
                recomputed = []
                for layer, mb, topk, again in step["calls"]:
                    if again:
                        recomputed.append((layer, mb, topk))
                    else:
                        assert (layer, mb) not in first
                        first[(layer, mb)] = topk
                # each recomputation re-ran one original call, with that call's budget
                assert sorted((layer, m) for layer, m, _ in recomputed) == sorted(
                    (layer, m) for layer in _expected_recomputed(name, rank["pp_rank"]) for m in range(M))
                assert all(first[(layer, m)] == k for layer, m, k in recomputed), (recomputed, first)

    def test_budgets_differ_so_capture_matters(long_corpus, tmp_path_factory, world):
        """The budgets vary between micro-batches in these runs, and recomputing with
        whatever budget the latest forward used changes the training."""
        base = _run("none", long_corpus, tmp_path_factory, world)
        for rank in base["ranks"]:
            tables = [np.asarray(s["budget"])[0] for s in rank["steps"]]  # [M, stages] per step
            # on this rank's stage, consecutive micro-batches got different budgets
            assert any((t[1:, rank["pp_rank"]] != t[:-1, rank["pp_rank"]]).any() for t in tables)
        broken = _run("full_uniform", long_corpus, tmp_path_factory, world, no_capture=True)
        # (measured: some gradient is off by ~10%, the grad norms by ~2e-4)
        assert max(_rel(broken["arrays"][k], base["arrays"][k]) for k in base["arrays"]) > 1e-3
        with pytest.raises(AssertionError):
            _assert_same_training(broken, base)

    def test_full_recompute_cuts_activation_memory():
        """8 layers at 4K tokens (small version of the 32K measurement in the docstring)."""
        small = [*PROJECT_RUN_FLAGS, "--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "256",
                 "--num-attention-heads", "4", "--sparse-attention", "--sb-block-size", "64",
                 "--sb-topk", "8", "--cpu", "--seed", "1"]
        res = measure_configs(4096, 2, ("none", "full"), model=small, side_by_side=2)  # 2 cores
        none, full = res["none"], res["full"]
        assert none["saved_left_mb"] == 0 and full["saved_left_mb"] == 0  # backward freed all
        # without recompute: ~20 hidden-sized tensors per layer; with it: each layer's input,
        # plus one layer's activations while that layer is recomputed
        assert none["saved_peak_mb"] > 8 * 10 * 4096 * 64 * 4 / 2**20
        assert full["saved_peak_mb"] <= none["saved_peak_mb"] / 3, res
        assert full["saved_after_forward_mb"] < full["saved_peak_mb"]  # the recompute was counted


if __name__ == "__main__":
    import megatron.training  # noqa: F401  (before megatron-core: its fusion compiles deferred)

    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "worker":
        _worker(rest)
    elif mode == "measure":
        print(json.dumps(_measure(rest)))
    elif mode == "memory":
        _memory_main(rest)
    else:
        raise SystemExit(f"unknown mode {mode!r} (worker, measure, memory)")
