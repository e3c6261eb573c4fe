"""World job of ``test_loss_chunks.py``: the driver's tiny GPT with the loss unchunked and in
chunks (``--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear --sb-loss-chunk-tokens
N``), the same weights, one forward+backward each on one packed THD micro-batch.

Arguments: ``OUT_DIR CHUNKS [pretrain_gpt.py flags]`` (``CHUNKS``: comma-separated chunk
sizes; the flags add e.g. ``--tensor-model-parallel-size 2 --sequence-parallel``). Each
rank writes ``OUT_DIR/rank<r>.pt``: ``{(tied, chunk): {"per_token", "loss", "grads",
"saved_peak"}}`` with chunk 0 the unchunked run; ``grads`` holds every parameter's gradient
(this rank's shard under TP) by name.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TOKENS, VOCAB, HIDDEN = 96, 4096, 32
DOCS = (0, 40, 70, 96)
"""cu_seqlens of the packed micro-batch: three documents."""
LINEAR = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear"]


def batch():
    """Token ids ``[1, T + 1]``, positions, packed-sequence params and a loss mask with zeros."""
    import numpy as np
    import torch

    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, TOKENS + 1), generator=g)
    cu = torch.tensor(DOCS, dtype=torch.int32)
    lengths = np.diff(DOCS)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()))
    mask = torch.ones(1, TOKENS)
    mask[:, 30:45] = 0  # a masked span across a document boundary
    mask[:, DOCS[1] - 1] = mask[:, DOCS[2] - 1] = 0  # documents' last tokens have no target
    return ids, pos, packed, mask


def step(model) -> dict:
    """One forward+backward; the saved-for-backward peak counted as test_recompute.py does."""
    import torch

    from megatron.training import loss_chunks
    from tests.training._saved_bytes import SavedBytes

    loss_chunks.loss_path["used"] = None
    ids, pos, packed, mask = batch()
    counter = SavedBytes(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        per_token = model(ids[:, :-1], pos, None, labels=ids[:, 1:], packed_seq_params=packed)
        loss = (per_token * mask).sum() / mask.sum()
        loss.backward()
    assert counter.live == 0, counter.live  # backward released everything that was saved
    return {"per_token": per_token.detach(), "loss": loss.detach(), "saved_peak": counter.peak,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "params": len(list(model.parameters())), "class": type(model).__name__,
            "path": loss_chunks.loss_path["used"]}


def main(argv) -> None:
    import tempfile

    import numpy as np
    import torch

    from megatron.training import initialize as init
    from megatron.training import model as M
    from megatron.training import quiet_optional_extras
    from megatron.training.arguments import parse_args
    from megatron.training.indexed_io import write_documents

    quiet_optional_extras()
    out, chunks, extra = argv[0], [int(c) for c in argv[1].split(",")], argv[2:]
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as d:
        write_documents(f"{d}/c", [np.ones(8, dtype=np.int64)], VOCAB)
        base = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
                "--seq-length", str(TOKENS), "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "1",
                "--position-embedding-type", "rope", "--data-path", f"{d}/c", "--cpu", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--tokenizer-type", "ByteTokenizer", *extra]  # exact comparisons

        def args_of(flags, tied):
            return parse_args([*base, *flags, *([] if tied else ["--untie-embeddings-and-output-weights"])], ws)

        init.initialize(args_of([], False))
        results = {}
        for tied in (False, True):
            args = args_of([], tied)
            torch.manual_seed(0)
            plain = M.build_gpt_chunks(args, M.transformer_config(args, use_cpu=True), VOCAB)[0]
            results[(tied, 0)] = step(plain)
            for chunk in chunks:
                args = args_of([*LINEAR, "--sb-loss-chunk-tokens", str(chunk)], tied)
                model = M.build_gpt_chunks(args, M.transformer_config(args, use_cpu=True), VOCAB)[0]
                model.load_state_dict(plain.state_dict())
                results[(tied, chunk)] = step(model)
    torch.save(results, os.path.join(out, f"rank{torch.distributed.get_rank()}.pt"))
    init.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
