"""The output layer and the loss in chunks of tokens: Megatron-LM's linear + cross-entropy fusion.

megatron-core's ``GPTModel`` computes the logits of every token of a micro-batch,
``[tokens, vocab / TP]``, and its cross entropy keeps an fp32 copy of them for backward:
for the Qwen2.5-0.5B preset (vocab 151,936) at 64K tokens that is 40 GB, with their bf16
copy and gradient about 60 GB. Megatron-LM's ``--cross-entropy-loss-fusion
--cross-entropy-fusion-impl linear`` (its ``dev`` branch: ``LinearCrossEntropyModule``, a
Blackwell kernel) fuses the output layer with the loss so that the logits are never whole.
Here the same flags run :func:`chunked_output_loss`: the tokens go through the output layer
and the model's own ``compute_language_model_loss`` a chunk at a time, each chunk under
activation checkpointing (``torch.utils.checkpoint``, non-reentrant), so backward
recomputes that chunk's logits and only one chunk's logits are alive at once. The loss per
token, and so every gradient, is that of the unchunked path (the same ops on fewer rows).

Tensor parallelism: every TP rank holds the same tokens and a slice of the vocabulary;
each chunk runs the vocab-parallel cross entropy with its collectives, and all ranks run
the same chunks in the same order (forward and recomputation alike). Sequence
parallelism: each TP rank holds ``1/TP`` of the tokens and the output layer all-gathers
them, so a chunk of ``c`` local rows yields the rows ``r * s/TP + [i, i + c)`` of every rank
``r``; the labels are taken, and the loss put back, in that order.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from torch.utils.checkpoint import checkpoint

from megatron.training import linear_ce


def chunked_output_loss(model, hidden: torch.Tensor, labels: torch.Tensor, weight, chunk_tokens: int,
                        sp_ranks: int = 1) -> torch.Tensor:
    """Per-token loss of ``model``'s output layer + cross entropy, ``chunk_tokens`` rows at a time.

    Args:
        model: a megatron-core ``GPTModel`` of the last pipeline stage (its ``output_layer``
            and ``compute_language_model_loss`` are used as they are).
        hidden: the final hidden states ``[s / sp_ranks, b, h]`` (this rank's share of the
            sequence under sequence parallelism).
        labels: target ids ``[b, s]``.
        weight: the output weight to use (the tied embedding's), or None for the layer's own.
        chunk_tokens: local rows (sequence positions) per chunk, > 0; the last chunk may be shorter.
        sp_ranks: ranks the output layer all-gathers the sequence over (TP with sequence
            parallelism, else 1).

    Returns:
        The loss per token ``[b, s]``, as ``GPTModel`` returns it (unreduced, unmasked).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    rows, batch = hidden.shape[0], hidden.shape[1]
    if labels.shape != (batch, rows * sp_ranks):
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)} "
                         f"gathered over {sp_ranks} rank(s)")
    # [b, s] -> [b, ranks, s / ranks]: column j of rank r's share is sequence position r * s/ranks + j
    by_rank = labels.view(batch, sp_ranks, rows)

    def chunk_loss(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        logits, _ = model.output_layer(h, weight=weight)
        return model.compute_language_model_loss(lab, logits)  # [b, ranks * c]

    losses = []
    for start in range(0, rows, chunk_tokens):
        stop = min(start + chunk_tokens, rows)
        lab = by_rank[:, :, start:stop].reshape(batch, sp_ranks * (stop - start))
        loss = checkpoint(chunk_loss, hidden[start:stop], lab, use_reentrant=False)
        losses.append(loss.view(batch, sp_ranks, stop - start))
    return torch.cat(losses, dim=2).view(batch, sp_ranks * rows)


loss_path = {"used": None}
"""How the last chunked step computed its loss: ``fused`` (linear_ce) or ``checkpointed``."""


class ChunkedLossGPTModel(GPTModel):
    """``GPTModel`` with ``loss_chunk_tokens``: when labels are given on the last stage, the
    output layer and the loss run in chunks: at TP = 1 as one autograd step that never keeps
    the logits (:func:`megatron.training.linear_ce.linear_cross_entropy`), else checkpointed
    (:func:`chunked_output_loss`); logits (labels None), multi-token prediction and inference
    take megatron-core's own path."""

    def __init__(self, *args, loss_chunk_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_chunk_tokens = loss_chunk_tokens

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        plain = (labels is None or not self.post_process or kwargs.get("mtp_in_postprocess")
                 or self.config.mtp_num_layers is not None or kwargs.get("inference_context") is not None)
        if plain:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if linear_ce.supported(self) is None:  # one autograd step, logits never kept (TP = 1)
            weight = self.output_layer.weight if weight is None else weight
            loss_path["used"] = "fused"
            return linear_ce.linear_cross_entropy(hidden_states, weight, labels, self.loss_chunk_tokens)
        loss_path["used"] = "checkpointed"
        sp_ranks = self.config.tensor_model_parallel_size if self.output_layer.sequence_parallel else 1
        return chunked_output_loss(self, hidden_states, labels, weight, self.loss_chunk_tokens, sp_ranks)
