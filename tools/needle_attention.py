"""Where each attention head of a pretrain_gpt.py checkpoint reads while it writes a needle's value.

Runs held-out ``niah_single`` samples under teacher forcing (as
``tools/eval_longctx.py`` scores them, dense attention), records the query and key
tensors that reach every layer's core attention (forward pre-hooks; the keys are
rotated already; ``attended`` applies ``--smeared-keys`` and ``--qk-conv`` as
training does) and,
for the queries that predict the answer's digits, reports per layer and head: the
attention mass on the needle's value, how often the strongest key is the digit to
write (offset 0: copying by content), the offsets it reads at instead, and the digit
accuracy when the head reads at its usual offset and when it slips
(``sparsebalance/eval/attention_probe.py`` says what each number is).

    OMP_NUM_THREADS=1 .venv/bin/python tools/needle_attention.py --load RUN/ckpt \\
        --train-args "$(cat RUN/model_flags.txt)" --lengths 1024,4096 --num-samples 20 --seed 86
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
from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402  (no megatron-core import)

PROG = "needle_attention.py"


def fail(message: str, code: int = 2) -> NoReturn:
    usage_error(message, prog=PROG, code=code)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py --save")
    p.add_argument("--train-args", default=None,
                   help="pretrain_gpt.py flags of the run (model shape), for checkpoints that do not "
                        "store their arguments")
    p.add_argument("--lengths", default="1024,4096", help="comma list of context lengths (tokens)")
    p.add_argument("--num-samples", type=int, default=20, help="niah_single samples per length")
    p.add_argument("--seed", type=int, default=86, help="generator seed (split 'eval')")
    p.add_argument("--value-digits", type=int, default=7, help="digits of the needle's value")
    p.add_argument("--window", type=int, default=64,
                   help="offsets from the digit to write beyond this count as 'far'")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    p.add_argument("--output", default=None, help="also write the JSON report here (atomically)")
    p.add_argument("--quiet", action="store_true", help="no per-sample progress on stderr")
    return p


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"--lengths must be comma-separated integers, got {text!r}")
    if not lengths:
        fail("--lengths is empty")
    return lengths


def format_report(rep: dict) -> str:
    lines = []
    for n, cell in rep["lengths"].items():
        lines.append(f"niah_single at {n} tokens, {cell['n']} samples: value digits right {cell['digit_accuracy']:.2f} "
                     f"(per digit: {' '.join(f'{a:.2f}' for a in cell['position_accuracy'])})")
        lines.append(f"{'head':<7} {'value mass':>10} {'on digit':>9} {'usual offset':>13} "
                     f"{'right there':>12} {'elsewhere':>10}  strongest key, offset from the digit (share)")
        for h in cell["heads"]:
            fmt = lambda x: "-" if x is None else f"{x:.2f}"
            mode = "-" if h["mode_offset"] is None else f"{h['mode_offset']:+d} ({h['at_mode']:.2f})"
            offs = " ".join(f"{o if isinstance(o, str) else format(o, '+d')}:{s:.2f}" for o, s in h["offsets"])
            lines.append(f"L{h['layer']}h{h['head']:<4} {h['value_mass']:>10.2f} {h['on_target']:>9.2f} {mode:>13} "
                         f"{fmt(h['acc_at_mode']):>12} {fmt(h['acc_off_mode']):>10}  {offs}")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    lengths = parse_lengths(args.lengths)
    for name in ("num_samples", "value_digits", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if args.window < 0:
        fail("--window must be >= 0")
    from sparsebalance.eval.tasks import TaskConfig, generate

    try:
        cfg = TaskConfig(value_digits=args.value_digits)
        samples = {n: [generate("niah_single", n, args.seed, i, config=cfg) for i in range(args.num_samples)]
                   for n in lengths}
    except ValueError as e:
        fail(str(e))
    if not os.path.isdir(args.load):
        fail(f"--load: {args.load} is not a directory")

    import torch

    from eval_longctx import open_eval_model

    # Quiets megatron's optional-extras warnings before anything imports megatron-core.
    model, args.threads = open_eval_model(args.load, args.train_args, args.threads, fail, sparse=False,
                                          sb_topk=None, sb_block_size=None, backend=None)
    from sparsebalance.eval.attention_probe import NeedleAttention, attention_rows, needle_value_start
    from sparsebalance.eval.tasks import ANSWER_END
    from sparsebalance.eval.tokenizer import get_tokenizer
    if max(lengths) > model.max_positions:
        model.close()
        fail(f"--lengths: {max(lengths)} tokens exceed the model's max positions {model.max_positions}")

    seen: dict = {}
    hooks = []
    for layer in model.gpt.decoder.layers:
        core = layer.self_attention.core_attention

        def grab(module, a, kw, number=layer.layer_number):
            with torch.no_grad():  # the queries and keys it attends with (--smeared-keys, --qk-conv)
                cu = torch.tensor([0, a[1].shape[0]], dtype=torch.int32)
                q, k = module.attended(a[0], a[1], cu)
            seen[number] = (q.detach(), k, module.softmax_scale)

        hooks.append(core.register_forward_pre_hook(grab, with_kwargs=True))

    tok = get_tokenizer()
    rep = {"load": args.load, "iteration": model.iteration, "task": "niah_single", "seed": args.seed,
           "value_digits": args.value_digits, "window": args.window, "threads": args.threads, "lengths": {}}
    t0 = time.perf_counter()
    try:
        for n in lengths:
            acc = NeedleAttention(window=args.window)
            for i, s in enumerate(samples[n]):
                prompt, gold = tok.encode(s.prompt), tok.encode(s.answer + ANSWER_END)
                seen.clear()
                logits = model.logits([torch.tensor(prompt + gold[:-1])])[0]
                rows = [len(prompt) - 1 + j for j in range(len(s.answer))]
                right = [int(logits[r].argmax()) == gold[j] for j, r in enumerate(rows)]
                probs = {}
                for number, (q, k, scale) in seen.items():
                    if q.dim() != 3:  # THD: [T, H, D] for one packed document
                        raise RuntimeError(f"layer {number}: expected THD query, got shape {tuple(q.shape)}")
                    probs[number] = attention_rows(q, k, rows, scale)
                acc.add(probs, needle_value_start(s), right)
                if not args.quiet:
                    sys.stderr.write(f"\r[{n}: {i + 1}/{len(samples[n])}]")
            rep["lengths"][str(n)] = {"n": len(samples[n]), **acc.summary()}
    finally:
        for h in hooks:
            h.remove()
        model.close()
    if not args.quiet:
        sys.stderr.write("\n")
    rep["seconds"] = time.perf_counter() - t0
    if args.output:
        from sparsebalance.eval.mix import atomic_write_lines

        atomic_write_lines(args.output, [json.dumps(rep, indent=1)])
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
