"""``pretrain()`` that writes, or reports on loading, a Megatron-LM legacy checkpoint (test-only).

Environment (test-only; the driver has no such flags):

``SB_TEST_DUMP=DIR``
    rank 0 writes ``DIR/run.json``: per step the iteration, loss and learning rate, the
    summary, and (``load`` runs) ``loaded``: digests of the weights and of the optimizer's
    state right after the checkpoint was loaded.
``SB_TEST_LEGACY_SAVE=DIR:ITER``
    after step ITER, rank 0 writes ``DIR`` in Megatron-LM's legacy ``--ckpt-format torch``
    layout (``iter_XXXXXXX/mp_rank_00/model_optim_rng.pt`` with ``model``, ``args`` as
    Megatron-LM's namespace, ``iteration``, ``optimizer``, ``opt_param_scheduler``,
    ``rng_state``, plus ``latest_checkpointed_iteration.txt``), the layer-norm weights under
    Transformer Engine's fused names with ``_extra_state`` entries, as Megatron-LM's default
    ``--transformer-impl transformer_engine`` writes them; ``saved`` in ``run.json`` holds
    the same digests as ``loaded``. TP = PP = DP = 1.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def digests(state) -> dict:
    """Sum and sum of squares of the weights and of every optimizer-state tensor."""
    import torch

    params = [p.detach().double() for chunk in state.model for p in chunk.module.parameters()]
    moments = [v.double() for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer])
               for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    return {"params": [float(sum(p.sum() for p in params)), float(sum((p * p).sum() for p in params))],
            "moments": [float(sum(m.sum() for m in moments)), float(sum((m * m).sum() for m in moments)),
                        len(moments)]}


def megatron_lm_namespace(args) -> argparse.Namespace:
    """The model part of the namespace Megatron-LM pickles into its checkpoints (its names)."""
    return argparse.Namespace(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, group_query_attention=False, num_query_groups=1,
        kv_channels=args.kv_channels, seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, rotary_interleaved=False, normalization=args.normalization,
        norm_epsilon=args.norm_epsilon, swiglu=args.swiglu, squared_relu=False, add_bias_linear=True,
        add_qkv_bias=False, untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        apply_layernorm_1p=False, hidden_dropout=0.1, attention_dropout=0.1, num_experts=None,
        padded_vocab_size=args.padded_vocab_size, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        ckpt_format="torch", transformer_impl="transformer_engine")


def te_names(sd: dict) -> dict:
    """The local layers' state dict in Transformer Engine's spec names (fused layer norms)."""
    import io

    out = {}
    for name, value in sd.items():
        name = name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
        name = name.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
        out[name] = value
        if name.endswith("linear_qkv.weight"):
            out[name[:-len("weight")] + "_extra_state"] = io.BytesIO(b"te fp8 metadata")
    return out


def write_legacy(root: str, iteration: int, args, state) -> None:
    import torch

    path = os.path.join(root, f"iter_{iteration:07d}", "mp_rank_00")
    os.makedirs(path)
    torch.save({"args": megatron_lm_namespace(args), "checkpoint_version": 3.0, "iteration": iteration,
                "model": te_names(state.model[0].module.state_dict()), "optimizer": state.optimizer.state_dict(),
                "opt_param_scheduler": state.scheduler.state_dict(), "rng_state": [{"random_rng_state": None}]},
               os.path.join(path, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def main() -> None:
    import torch

    from megatron.training import checkpointing, quiet_optional_extras

    quiet_optional_extras()
    from megatron.training import training
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import shutdown

    args = parse_args()
    out = {"steps": []}
    legacy = os.environ.get("SB_TEST_LEGACY_SAVE")
    holder = {}
    load = checkpointing.load_checkpoint

    def load_checkpoint(*a, **k):
        it = load(*a, **k)
        holder["loaded"] = it
        return it

    checkpointing.load_checkpoint = load_checkpoint
    load_weights = checkpointing.load_weights

    def finetune_load(*a, **k):  # --finetune: the weights only, training starts at iteration 1
        load_weights(*a, **k)
        holder["loaded"] = 0
        return 0

    checkpointing.load_weights = finetune_load
    setup = training.setup

    def recording_setup(a):
        holder["state"] = state = setup(a)
        return state

    training.setup = recording_setup

    def on_step(iteration, state, result):
        if iteration == holder.get("loaded", -1) + 1:
            out["loaded"] = holder["loaded_digests"]
        out["steps"].append({"iteration": iteration, "loss": result.loss_sum / max(result.loss_tokens, 1),
                             "lr": float(state.optimizer.param_groups[0]["lr"])})
        if legacy and iteration == int(legacy.split(":")[1]) and torch.distributed.get_rank() == 0:
            write_legacy(legacy.split(":")[0], iteration, args, state)
            out["saved"] = digests(state)

    real_loop = training._train_loop

    def loop(a, state, hooks):
        if "loaded" in holder:
            holder["loaded_digests"] = digests(state)
        return real_loop(a, state, hooks)

    training._train_loop = loop
    out["summary"] = training.pretrain(args, on_step=on_step)
    if torch.distributed.get_rank() == 0:
        os.makedirs(os.environ["SB_TEST_DUMP"], exist_ok=True)
        with open(os.path.join(os.environ["SB_TEST_DUMP"], "run.json"), "w") as f:
            json.dump(out, f)
    shutdown()


if __name__ == "__main__":
    main()
