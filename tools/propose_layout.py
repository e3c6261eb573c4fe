#!/usr/bin/env python
"""Propose the layer split over pipeline stages that equalises their predicted times, and
print the Megatron-LM flags to paste into the launch line.

The stages are priced by the latency predictor (``--sb-cost-model`` or a ``--sb-profile`` of
tools/profile_latency.py) over micro-batches of the run's data (``--lengths``: a JSON list of
document lengths, packed whole in order into micro-batches of ``--seq-length`` x
``--micro-batch-size`` tokens; without it every micro-batch is one document of that length):
each stage's layers, plus the embedding on the first stage and the output layer and loss on
the last (:mod:`sparsebalance.pipeline.split`). ``pretrain_gpt.py --sb-auto-layout`` applies
the same proposal to the run itself.

Tiny CPU run (a second)::

    .venv/bin/python tools/propose_layout.py --num-layers 30 --hidden-size 576 --num-attention-heads 9 \\
        --num-query-groups 3 --ffn-hidden-size 1536 --vocab-size 49152 --seq-length 4096 \\
        --pipeline-model-parallel-size 4

GPU cluster (the run's shape, data and profile)::

    python tools/propose_layout.py --model-preset qwen2.5-0.5b --seq-length 65536 \\
        --pipeline-model-parallel-size 4 --lengths lengths.json --sb-profile profiles/qwen05b_h100.json \\
        --sb-block-size 256 --sb-topk 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.presets import MODEL_PRESETS  # noqa: E402
from sparsebalance.pipeline.split import (  # noqa: E402
    megatron_flags,
    near_even_split,
    pack_in_order,
    propose_split,
    spread,
    stage_costs,
)

SHAPE = {"num_layers": None, "hidden_size": None, "num_attention_heads": None, "num_query_groups": None,
         "kv_channels": None, "ffn_hidden_size": None, "vocab_size": None}
"""Model-shape flags (argparse dests); a preset fills the ones not given."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="propose_layout.py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), help="a published model's shape")
    for dest in SHAPE:
        p.add_argument("--" + dest.replace("_", "-"), type=_positive, default=None)
    p.add_argument("--no-swiglu", action="store_true", help="a two-matrix MLP (default: SwiGLU)")
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=_positive, required=True)
    p.add_argument("--seq-length", type=_positive, required=True, help="tokens of a sequence")
    p.add_argument("--micro-batch-size", type=_positive, default=1, help="sequences packed in a micro-batch")
    p.add_argument("--lengths", help="JSON list of the data's document lengths (default: one document a "
                                     "micro-batch)")
    p.add_argument("--microbatches", type=_positive, default=256, help="micro-batches priced (default 256)")
    p.add_argument("--sb-cost-model", default=None, help="predictor by name (default h100-analytic)")
    p.add_argument("--sb-profile", default=None, help="predictor: a tools/profile_latency.py profile")
    p.add_argument("--sb-block-size", type=_positive, default=64, help="routing block, tokens (default 64)")
    p.add_argument("--sb-topk", type=int, default=None, help="sparse attention's budget (default: dense)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return p


def _shape(a, p) -> dict:
    shape = dict(MODEL_PRESETS[a.model_preset]) if a.model_preset else {}
    out = {k: getattr(a, k) if getattr(a, k) is not None else shape.get(k) for k in SHAPE}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
               if out[k] is None]
    if missing:
        p.error(f"give --model-preset or --{missing[0].replace('_', '-')}")
    out["num_query_groups"] = out["num_query_groups"] or out["num_attention_heads"]
    out["swiglu"] = not a.no_swiglu and shape.get("swiglu", True)
    return {k: v for k, v in out.items() if v is not None}


def _microbatches(a) -> list:
    tokens = a.seq_length * a.micro_batch_size
    if a.lengths is None:
        return [[tokens]]
    with open(a.lengths) as fh:
        try:
            lengths = json.load(fh)
        except ValueError as e:  # not JSON, or not UTF-8 text
            raise ValueError(f"--lengths {a.lengths}: not JSON ({e})") from None
    if not isinstance(lengths, list) or not all(isinstance(n, int) for n in lengths):
        raise ValueError(f"--lengths {a.lengths}: expected a JSON list of document lengths")
    mbs = pack_in_order(lengths, tokens, a.microbatches)
    if not mbs:
        raise ValueError(f"--lengths {a.lengths}: no document of positive length")
    return mbs


def propose(a, p) -> dict:
    """The proposal as a JSON-ready dict (ValueError / OSError for bad input)."""
    from sparsebalance.predictor import get_predictor

    if a.sb_cost_model and a.sb_profile:
        p.error("give --sb-cost-model or --sb-profile, not both")
    shape = _shape(a, p)
    name = a.sb_profile or a.sb_cost_model or "h100-analytic"
    predictor = get_predictor(name, block_size=a.sb_block_size, topk=a.sb_topk, **shape)
    mbs = _microbatches(a)
    costs = stage_costs(predictor, mbs, a.pp, topk=a.sb_topk)
    layers = propose_split(costs, shape["num_layers"])
    even = near_even_split(shape["num_layers"], a.pp)
    out = {"pp": a.pp, "num_layers": shape["num_layers"], "microbatches": len(mbs), "predictor": name,
           "layer_ms": costs.layer_ms, "extra_ms": list(costs.extra_ms), "stage_layers": list(layers),
           "stage_ms": costs.stage_ms(layers).tolist(), "spread": spread(costs.stage_ms(layers)),
           "flags": megatron_flags(layers)}
    out["even"] = {"stage_layers": list(even), "stage_ms": costs.stage_ms(even).tolist(),
                   "spread": spread(costs.stage_ms(even))}
    return out


def _show(ms) -> str:
    return "[" + " ".join(f"{t:.1f}" for t in ms) + "] ms"


def main(argv=None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    try:
        out = propose(a, p)
    except (OSError, ValueError) as e:
        sys.stderr.write(f"propose_layout.py: error: {' '.join(str(e).split())}\n")
        return 2
    if a.json:
        print(json.dumps(out))
        return 0
    ev = out["even"]
    print(f"{'even' if len(set(ev['stage_layers'])) == 1 else 'near-even'} split {ev['stage_layers']}: "
          f"{_show(ev['stage_ms'])}, slowest / fastest - 1 = {100 * ev['spread']:.1f}%")
    print(f"proposed split {out['stage_layers']}: {_show(out['stage_ms'])}, slowest / fastest - 1 = "
          f"{100 * out['spread']:.1f}%")
    print("flags: " + (" ".join(f"'{x}'" if "|" in x else x for x in out["flags"]) or "(none: the even split)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
