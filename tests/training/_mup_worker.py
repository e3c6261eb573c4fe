"""World worker of ``test_mup.py``: ``pretrain_gpt.py ARGS`` that also writes, on rank 0,
``$SB_TEST_DUMP`` (JSON): right after the model is built, the standard deviation of each
weight that muP initializes (the first layer's QKV, attention output and FC2 weights, the word
embeddings, the output layer where untied), the core attention's softmax scale, the
multipliers the config carries; and each optimizer parameter group (its parameters' names,
peak / minimum LR, Adam epsilon)."""

from __future__ import annotations

from _arch_worker import run_pretrain  # this file's directory is sys.path[0]


def main() -> None:
    from megatron.training import model

    dump = {}
    build_model, build_optimizer = model.build_model, model.build_optimizer

    def built(*a, **k):
        chunks = build_model(*a, **k)
        inner = chunks[0].module
        layer = inner.decoder.layers[0]
        weights = {"qkv": layer.self_attention.linear_qkv.weight, "proj": layer.self_attention.linear_proj.weight,
                   "fc2": layer.mlp.linear_fc2.weight, "embedding": inner.embedding.word_embeddings.weight}
        if inner.output_layer.weight is not None:
            weights["output"] = inner.output_layer.weight
        dump["std"] = {k: w.detach().float().std().item() for k, w in weights.items()}
        dump["softmax_scale"] = layer.self_attention.core_attention.softmax_scale
        return chunks

    def optimizer(args, chunks):
        opt, scheduler = build_optimizer(args, chunks)
        names = {id(p): n.removeprefix("module.") for c in chunks for n, p in c.named_parameters()}
        dump["groups"] = [{"params": sorted(names[id(p)] for p in g["params"]), "max_lr": g["max_lr"],
                           "min_lr": g["min_lr"], "eps": g["eps"]} for g in opt.param_groups]
        return opt, scheduler

    model.build_model, model.build_optimizer = built, optimizer
    run_pretrain(dump)


if __name__ == "__main__":
    main()
