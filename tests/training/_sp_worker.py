"""World job of ``test_sequence_parallel.py``: one forward+backward of the driver's GPT
under tensor parallelism, counting the bytes saved for backward, after checking the
collectives megatron-core's sequence parallelism calls on this backend.

Arguments: pretrain_gpt.py's flags (``--tensor-model-parallel-size``, with or without
``--sequence-parallel``) plus ``--tokens T --docs D`` (one packed micro-batch of T
tokens in D documents, built and padded as the driver's data path does). Each rank
writes ``$SB_TEST_DUMP/rank<r>.json``: the micro-batch's stored rows, the saved-for-
backward peak (bytes), the loss, and the collectives' check.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def check_collectives(group) -> dict:
    """``all_gather_into_tensor`` and ``reduce_scatter_tensor`` over ``group``, blocking and
    with ``async_op=True`` (the column-parallel linear's backward), against gathering
    and summing the ranks' inputs by hand."""
    import torch

    dist = torch.distributed
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    inputs = [torch.arange(24.0).reshape(6, 4) * (r + 1) + r for r in range(size)]
    mine = inputs[rank]
    ok = {}
    for name, async_op in (("blocking", False), ("async", True)):
        gathered = torch.empty(6 * size, 4)
        handle = dist.all_gather_into_tensor(gathered, mine, group=group, async_op=async_op)
        if async_op:
            handle.wait()
        ok[f"all_gather_into_tensor/{name}"] = bool(torch.equal(gathered, torch.cat(inputs)))
        shard = torch.empty(6 // size, 4)
        handle = dist.reduce_scatter_tensor(shard, mine, group=group, async_op=async_op)
        if async_op:
            handle.wait()
        ok[f"reduce_scatter_tensor/{name}"] = bool(torch.equal(shard, sum(inputs).chunk(size)[rank]))
    return ok


def main() -> None:
    import argparse

    import torch
    from megatron.core import parallel_state as ps

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training import initialize as init
    from megatron.training import model as M
    from megatron.training.arguments import parse_args
    from megatron.training.data import sequence_parallel_pad_microbatch
    from megatron.training.step import forward_step
    from megatron.training.tokenizer import padded_vocab_size, vocab_size_for
    from tests.training._saved_bytes import SavedBytes

    own = argparse.ArgumentParser(prog="_sp_worker.py")
    own.add_argument("--tokens", type=int, required=True)
    own.add_argument("--docs", type=int, default=1)
    own, rest = own.parse_known_args()
    args = parse_args(rest)
    init.initialize(args)
    checks = check_collectives(ps.get_tensor_model_parallel_group())
    vocab = padded_vocab_size(vocab_size_for(args.tokenizer_type, args.tokenizer_model, args.vocab_size),
                              args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    model = M.build_gpt_chunks(args, M.transformer_config(args, use_cpu=True), vocab)[0]
    T, D = own.tokens, own.docs
    ids = torch.randint(0, vocab, (1, T + 1), generator=torch.Generator().manual_seed(0))
    bounds = [T * i // D for i in range(D + 1)]
    mb = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(1, T),
          "position_ids": torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])]).unsqueeze(0),
          "cu_seqlens": torch.tensor(bounds, dtype=torch.int32)}
    if args.sequence_parallel:
        mb = sequence_parallel_pad_microbatch(mb, args.tensor_model_parallel_size)
    counter = SavedBytes(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        output, loss_fn = forward_step(iter([mb]), model)
        loss_sum, tokens, _ = loss_fn(output)
        loss_sum.backward()
    out = {"rank": torch.distributed.get_rank(), "rows": int(mb["tokens"].shape[1]),
           "saved_peak_bytes": counter.peak, "loss": float(loss_sum) / float(tokens),
           "collectives": checks}
    dump = os.environ["SB_TEST_DUMP"]
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)
    init.shutdown()


if __name__ == "__main__":
    main()
