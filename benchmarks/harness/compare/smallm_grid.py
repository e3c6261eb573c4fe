"""The small-M grid of issue 58: megatron, sab, sparsebalance and wlb in WLB-LLM's regime.

Cells: every length file x PP x context x micro-batches per replica M in {PP, 2 x PP, 32} x
attention (dense: every block kept; sparse: top-k), at DP 8, CP 1, llama7b's shape on
h100-analytic. Per cell:

* ``epoch``: each packer (megatron, sab, wlb) packs the whole of epoch 0, flush steps
  included, so every arm trains every token exactly once and nothing is left waiting at
  the end (a fixed number of steps favours packers that hold expensive documents back:
  the last steps' held documents are never paid for). Tokens per predicted ms from the
  packer's own step times, which are the simulator's static (k0) times
  (``cluster_sim``'s ``packer_vs_instance_max_rel_err``); WLB-LLM's imbalance degree per
  step (slowest micro-batch / mean micro-batch of the step, = max x PP / sum at M = PP,
  DP = 1), averaged over steps; SAB's and WLB's waits (steps each item waited, counted
  per item); SAB's planning time per step (the sampler's call, predictions included) as
  thread CPU ms (median; share = median x steps / predicted epoch) and as wall ms (median
  and max; share = summed wall / predicted epoch, the target's measure), the
  ``OMP_NUM_THREADS`` it ran with and the machine's load average (planning time on a
  shared machine is inflated by the other jobs: the wall share is an upper bound).
* ``sim`` (sparse cells): ``cluster_sim.simulate_cell`` with megatron, sab,
  sparsebalance (sab + critical-path DST) and wlb on the first ``--sim-steps`` steps,
  as ``benchmarks/compare.py --mode sim`` runs it; dense cells skip it (the instances of
  every-block budgets are slow to build, and DST has no budget above "every block").

Command (results/scaling_smallm/)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.harness.compare.smallm_grid \\
        --out results/scaling_smallm/grid.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time

import numpy as np

from sparsebalance.batching import PackingSampler

from .cluster_sim import MODELS, SimConfig, simulate_cell

PACKERS = ("megatron", "sab", "wlb")
SIM_ARMS = ("megatron", "sab", "sparsebalance", "wlb")


def epoch_run(lengths: np.ndarray, seq: int, cfg: SimConfig, strategy: str) -> dict:
    """One packer over the whole of epoch 0 (see the module docstring)."""
    s = PackingSampler(lengths, dp=cfg.dp, micro_batches=cfg.micro_batches, seq_length=seq,
                       strategy=strategy, seed=cfg.seed, max_carry_steps=cfg.max_carry_steps,
                       predictor=cfg.predictor(), pp=cfg.pp)
    tokens, ms, pack, wall, imb, waits = 0, 0.0, [], [], [], []
    while True:
        before = s.carried
        ages = {(int(d), int(o)): int(a) for d, o, a in zip(before.doc, before.offset, before.age)}
        p = s.next_step()
        if p.epoch > 0:
            break
        tokens += p.tokens
        ms += p.step_ms
        pack.append(p.pack_ms)
        wall.append(p.pack_wall_ms)
        mb = p.microbatch_ms[p.microbatch_ms > 0]
        imb.append(float(mb.max() / mb.mean()))
        waits += [ages.get((d, o), 0) for r in p.ranks for b in r for d, o, _ in b]
    hist = np.bincount(waits, minlength=cfg.max_carry_steps + 1)
    return {"steps": len(pack), "tokens": tokens, "tokens_per_ms": tokens / ms,
            "imbalance_degree": float(np.mean(imb)), "pack_ms": float(np.median(pack)),
            "pack_share_of_step": float(np.median(pack)) * len(pack) / ms,
            "pack_wall_ms": float(np.median(wall)), "pack_wall_ms_max": float(np.max(wall)),
            "pack_wall_share_of_step": float(np.sum(wall)) / ms,
            "waits": {"items_by_steps_waited": hist.tolist(), "max": int(np.flatnonzero(hist)[-1])}}


def render(cells: list) -> str:
    """Markdown table of the cells and the issue's targets, met or not."""
    head = ("| file | PP | context | M | attention | sab (epoch) | wlb (epoch) | sab / wlb | imbalance sab / wlb "
            "| sab plan ms: wall median / max, cpu (wall share of step) | sab items by steps waited "
            "| sim: sab / SB / wlb | sim SB / wlb |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    sb_over_wlb, sparse, dense_ppm, shares = [], [], [], []
    order = ("pp", "M", "seq_length", "attention", "file")
    for c in sorted(cells, key=lambda c: tuple(c[k] for k in order)):
        e, arms = c["epoch"]["speedup_vs_megatron"], c["epoch"]["arms"]
        sim = c.get("sim")
        # SparseBalance = sab + DST: dense cells have no sim (DST cannot raise "every block"),
        # so there SparseBalance is sab; sparse cells take the lower of the epoch's sab / wlb
        # and the sim's sparsebalance / wlb.
        r = e["sab"] / e["wlb"]
        if sim:
            ss = sim["speedup_vs_megatron"]
            r = min(r, ss["sparsebalance"] / ss["wlb"])
            sparse.append(r)
        elif c["M"] == c["pp"] and c["seq_length"] == 131072:
            dense_ppm.append((e["sab"], arms["sab"]["imbalance_degree"]))
        sb_over_wlb.append(r)
        w = arms["sab"]["waits"]["items_by_steps_waited"]
        sab = arms["sab"]
        if "pack_wall_ms" in sab:
            # median wall x steps / predicted epoch (as the CPU share): less swayed than the
            # sum by the moments another job holds the core
            wall_med = sab["pack_wall_ms"] / sab["pack_ms"] * sab["pack_share_of_step"]
            shares.append((sab["pack_wall_share_of_step"], sab["pack_share_of_step"], wall_med, c))
            plan = (f"{sab['pack_wall_ms']:.0f} / {sab['pack_wall_ms_max']:.0f}, {sab['pack_ms']:.0f} "
                    f"({100 * sab['pack_wall_share_of_step']:.2f}%)")
        else:  # a cell from before the wall time was kept
            plan = f"- / -, {sab['pack_ms']:.0f} (cpu {100 * sab['pack_share_of_step']:.2f}%)"
        lines.append(
            f"| {c['file']} | {c['pp']} | {c['seq_length'] // 1024}K | {c['M']} | {c['attention']} | {e['sab']:.3f} "
            f"| {e['wlb']:.3f} | {e['sab'] / e['wlb']:.3f} | {arms['sab']['imbalance_degree']:.2f} / "
            f"{arms['wlb']['imbalance_degree']:.2f} | {plan} | {' / '.join(map(str, w))} | "
            + (f"{ss['sab']:.3f} / {ss['sparsebalance']:.3f} / {ss['wlb']:.3f} | "
               f"{ss['sparsebalance'] / ss['wlb']:.3f} |" if sim else "- | - |"))
    out = "\n".join(lines) + "\n\n"
    if sb_over_wlb:
        out += (f"SparseBalance / wlb: min {min(sb_over_wlb):.3f}, median {np.median(sb_over_wlb):.3f} over "
                f"{len(sb_over_wlb)} cells; sparse cells median {np.median(sparse) if sparse else float('nan'):.3f}; "
                "dense M = PP at 128K: "
                + ", ".join(f"{x:.3f}x megatron (imbalance {i:.2f})" for x, i in dense_ppm) + "\n")
    if shares:
        def worst(i):
            x = max(shares, key=lambda t: t[i])
            c = x[-1]
            return (f"{100 * x[i]:.2f}% ({c['file']} PP {c['pp']} {c['seq_length'] // 1024}K M {c['M']} "
                    f"{c['attention']})")

        load = sorted({round(x, 1) for *_, cc in shares for x in cc.get("load_avg", [])})
        threads = sorted({str(cc.get("omp_num_threads")) for *_, cc in shares})
        out += (f"\nSAB's planning, share of the predicted step over {len(shares)} cells, largest: "
                f"wall time summed over the epoch {worst(0)}; median wall x steps {worst(2)}; thread "
                f"CPU time, median x steps {worst(1)}. OMP_NUM_THREADS {', '.join(threads)}; 1-minute "
                f"load average during the cells {load[0]}-{load[-1]} (shared machine: the wall times "
                "include waiting for a core).\n")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="*", default=None, help="length files (default data/lengths/*.json)")
    p.add_argument("--model", default="llama7b", choices=sorted(MODELS))
    p.add_argument("--pp", default="4,8")
    p.add_argument("--seq-lengths", default="65536,131072")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--sparse-topk", type=int, default=32)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--sim-steps", type=int, default=6)
    p.add_argument("--max-carry-steps", type=int, default=2,
                   help="longest wait of a deferred document, steps, for every arm (default 2)")
    p.add_argument("--ms", default="pp,2pp,32", help="micro-batches per replica: any of pp, 2pp, 32")
    p.add_argument("--out", required=True, help="JSON list of cells (cells already in it are kept)")
    p.add_argument("--markdown", default=None, help="only write the table of --out's cells to this file")
    a = p.parse_args(argv)
    if a.markdown:
        with open(a.markdown, "w") as fh:
            fh.write(render(json.load(open(a.out))))
        return
    ms_set = a.ms.split(",")
    if not ms_set or any(m not in ("pp", "2pp", "32") for m in ms_set):
        raise SystemExit(f"smallm_grid: --ms takes pp, 2pp, 32, got {a.ms!r}")
    if a.max_carry_steps < 0:
        raise SystemExit(f"smallm_grid: --max-carry-steps must be >= 0, got {a.max_carry_steps}")
    files = a.lengths or sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3,
                                                       "data", "lengths", "*.json")))
    if not files:
        raise SystemExit("smallm_grid: no length files (pass --lengths)")
    data = {os.path.splitext(os.path.basename(f))[0]: np.asarray(json.load(open(f)), dtype=np.int64)
            for f in files}
    cells = json.load(open(a.out)) if os.path.exists(a.out) else []
    threads = os.environ.get("OMP_NUM_THREADS")
    print(f"smallm_grid: OMP_NUM_THREADS={threads}, load average {os.getloadavg()[0]:.2f}", flush=True)
    done = {(c["file"], c["pp"], c["seq_length"], c["M"], c["attention"]) for c in cells}
    pps = [int(x) for x in a.pp.split(",")]
    todo = [(pp, M, seq, name, att) for ms in ms_set for pp in pps
            for M in [{"pp": pp, "2pp": 2 * pp, "32": 32}[ms]] if ms != "32" or M > 2 * pp
            for seq in map(int, a.seq_lengths.split(",")) for name in data for att in ("dense", "sparse")]
    for pp, M, seq, name, attention in todo:  # M = PP first: the regime of the issue
        if (name, pp, seq, M, attention) in done:
            continue
        k = -(-seq // a.block_size) if attention == "dense" else a.sparse_topk
        cfg = SimConfig(pp=pp, dp=a.dp, micro_batches=M, steps=a.sim_steps, topk=k,
                        block_size=a.block_size, model=tuple(MODELS[a.model].items()),
                        max_carry_steps=a.max_carry_steps)
        t0, load0 = time.time(), os.getloadavg()[0]
        ep = {s: epoch_run(data[name], seq, cfg, s) for s in PACKERS}
        row = {"file": name, "model": a.model, "pp": pp, "dp": a.dp, "seq_length": seq, "M": M,
               "attention": attention, "topk": k, "block_size": a.block_size,
               "max_carry_steps": a.max_carry_steps,
               "epoch": {"speedup_vs_megatron": {s: ep[s]["tokens_per_ms"] / ep["megatron"]["tokens_per_ms"]
                                                 for s in PACKERS}, "arms": ep}}
        if attention == "sparse":
            t = simulate_cell(data[name], seq, cfg, arms=SIM_ARMS, frontier=False).table
            row["sim"] = {"steps": a.sim_steps,
                          "speedup_vs_megatron": {x: t["arms"][x]["speedup_vs_megatron"] for x in SIM_ARMS},
                          "imbalance_degree": {x: t["arms"][x]["imbalance_microbatch"] for x in SIM_ARMS},
                          "packer_vs_instance_max_rel_err": t["packer_vs_instance_max_rel_err"]}
        row["seconds"] = time.time() - t0
        row["omp_num_threads"] = threads
        row["load_avg"] = [load0, os.getloadavg()[0]]  # 1-minute load at the cell's start and end
        cells.append(row)
        with open(a.out, "w") as fh:
            json.dump(cells, fh, indent=1)
        e = row["epoch"]["speedup_vs_megatron"]
        sim = row.get("sim", {}).get("speedup_vs_megatron", {})
        print(f"{name} pp{pp} {seq // 1024}K M{M} {attention}: epoch sab {e['sab']:.3f} wlb {e['wlb']:.3f}"
              + (f" | sim sab {sim['sab']:.3f} sb {sim['sparsebalance']:.3f} wlb {sim['wlb']:.3f}" if sim else "")
              + f" ({row['seconds']:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
