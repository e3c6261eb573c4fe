"""``--micro-batch-size N`` (Megatron-LM's N sequences per micro-batch) trains: one packed
THD micro-batch of up to N x ``--seq-length`` tokens, documents still chunked at
``--seq-length``, ``--global-batch-size`` / (N x DP) micro-batches a step."""

from conftest import PRETRAIN, TINY, summary_of


def test_micro_batch_of_two_sequences_trains(corpus, tmp_path, world):
    flags = [*TINY, "--data-path", corpus, "--train-iters", "3", "--micro-batch-size", "2",
             "--summary-json", str(tmp_path / "s.json")]
    s = summary_of(world.launch(PRETRAIN, flags))
    assert s["iterations"] == 3 and all(x == x for x in s["losses"])
    assert s["args"]["num_microbatches"] == 2 and s["args"]["global_batch_size"] == 4
    # 2 micro-batches of up to 2 x 256 tokens: steps hold more than 2 x 256
    assert max(s["step_tokens_all"]) > 2 * 256 and max(s["step_tokens_all"]) <= 4 * 256
