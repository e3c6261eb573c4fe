"""World worker of ``test_architecture_flags.py`` and ``test_run_checks.py``:
``pretrain_gpt.py ARGS`` that also writes, on rank 0, ``$SB_TEST_DUMP`` (JSON, when set):
the model chunk's config fields and module types the flags set, and each optimizer
parameter group (its parameters' names, peak / minimum LR, weight-decay multiplier, and
the LR it had at every step), how many times megatron-core's real-time test
(``--test-mode``) ran, and the micro-batches of each evaluation step.
``SB_TEST_PERTURB=output_layer`` (or ``q_layernorm``): rank 1 adds 1e-3 to its copy of that
weight (the first layer's, for ``q_layernorm``) right after the model is built (replicas
then differ)."""

from __future__ import annotations

import json
import os
import runpy
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")


def _describe(chunk) -> dict:
    inner = chunk.module
    layer = inner.decoder.layers[0]
    attn, cfg = layer.self_attention, inner.config
    return {"zero_centered_gamma": cfg.layernorm_zero_centered_gamma, "qk_layernorm": cfg.qk_layernorm,
            "attention_output_gate": cfg.attention_output_gate, "rotary_interleaved": cfg.rotary_interleaved,
            "activation": cfg.activation_func.__name__, "core_attention": type(attn.core_attention).__name__,
            "norms": sorted({type(m).__name__ for m in (layer.input_layernorm, layer.pre_mlp_layernorm,
                                                        inner.decoder.final_layernorm, attn.q_layernorm,
                                                        attn.k_layernorm) if m is not None}),
            "qkv_out": attn.linear_qkv.weight.shape[0]}


def main() -> None:
    from megatron.training import model

    build, dump = model.build_optimizer, {"groups": None}

    def build_optimizer(args, chunks):
        optimizer, scheduler = build(args, chunks)
        names = {id(p): n.removeprefix("module.") for c in chunks for n, p in c.named_parameters()}
        groups = optimizer.param_groups
        dump.update(model=_describe(chunks[0]), groups=[
            {"params": sorted(names[id(p)] for p in g["params"]), "max_lr": g["max_lr"], "min_lr": g["min_lr"],
             "wd_mult": g["wd_mult"], "lrs": []} for g in groups])
        step = scheduler.step

        def recorded(*a, **k):
            out = step(*a, **k)
            for g, d in zip(groups, dump["groups"]):
                d["lrs"].append(g["lr"])
            return out

        scheduler.step = recorded
        return optimizer, scheduler

    model.build_optimizer = build_optimizer
    from megatron.core.transformer.attention import SelfAttention

    realtime = SelfAttention.run_realtime_tests  # the world puts class attributes back after the job

    def counted(self):
        dump["realtime_tests"] = dump.get("realtime_tests", 0) + 1
        return realtime(self)

    SelfAttention.run_realtime_tests = counted
    from megatron.training import step

    run_schedule = step.run_schedule  # evaluate() looks it up at call time

    def recorded_schedule(args, chunks, batches, forward_only):
        if forward_only:
            dump.setdefault("eval_microbatches", []).append(len(batches.microbatches))
        return run_schedule(args, chunks, batches, forward_only=forward_only)

    step.run_schedule = recorded_schedule
    perturb = os.environ.get("SB_TEST_PERTURB")
    if perturb and int(os.environ.get("RANK", "0")) == 1:
        build_model = model.build_model

        def perturbed(*a, **k):
            chunks = build_model(*a, **k)
            inner = chunks[0].module
            weight = inner.output_layer.weight if perturb == "output_layer" else \
                inner.decoder.layers[0].self_attention.q_layernorm.weight
            with torch.no_grad():
                weight.add_(1e-3)
            return chunks

        model.build_model = perturbed
    run_pretrain(dump)


def run_pretrain(dump: dict) -> None:
    """``pretrain_gpt.py ARGS`` as ``__main__``; then, on rank 0, ``dump`` to ``$SB_TEST_DUMP``
    (when set), also after a failed run."""
    sys.argv = [PRETRAIN, *sys.argv[1:]]
    try:
        runpy.run_path(PRETRAIN, run_name="__main__")
    finally:
        if int(os.environ.get("RANK", "0")) == 0 and "SB_TEST_DUMP" in os.environ:
            with open(os.environ["SB_TEST_DUMP"], "w") as f:
                json.dump(dump, f)


if __name__ == "__main__":
    main()
