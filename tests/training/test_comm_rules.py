"""Megatron-LM flags accepted here as no-ops (the same results; megatron/training/comm_rules.py):
their Megatron-LM rules refuse in one line what Megatron-LM refuses, and what it accepts
parses here (parse only). Rules read from Megatron-LM main's ``validate_args``
(hierarchical CP, TP communication overlap), megatron-core's ``ModelParallelConfig.__post_init__`` (embedding wgrad
deferral), ``TransformerConfig`` (per-layer CP types) and ``parallel_state`` /
``DistributedDataParallel`` (partial distributed optimizer)."""

import pytest
from conftest import parsed, refused_line

QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local", "--num-layers", "4",
         "--untie-embeddings-and-output-weights"]


def resolve(*flags, world_size=1):
    return parsed(QUIET, *flags, world_size=world_size)


def refused(capsys, *flags, world_size=1):
    return refused_line(capsys, QUIET, *flags, world_size=world_size)


CP4 = ["--context-parallel-size", "4"]


@pytest.mark.parametrize("flags", [
    [*CP4, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"],
    [*CP4, "--cp-comm-type", "p2p", "a2a", "allgather", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4"],
    [*CP4, "--hierarchical-context-parallel-sizes", "2", "2"],   # the sizes alone: checked, nothing to use them
    ["--cp-comm-type", "p2p", "a2a"],                             # CP=1: megatron-core reads no type
])
def test_context_parallel_communication_accepted(flags):
    args = resolve(*flags, world_size=4)
    assert not [w for w in args.compat_warnings if "cp-comm" in w or "hierarchical" in w]


@pytest.mark.parametrize("flags,says", [
    ([*CP4, "--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    ([*CP4, "--hierarchical-context-parallel-sizes", "2", "4"], "multiply to 8, not --context-parallel-size 4"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "multiply to 4, not --context-parallel-size 1"),
    ([*CP4, "--cp-comm-type", "ring"], "--cp-comm-type ring: Megatron-LM's types are p2p, a2a, allgather, a2a+p2p"),
    ([*CP4, "--cp-comm-type", "p2p", "a2a"], "--cp-comm-type gives 2 types"),
    ([*CP4, "--hierarchical-context-parallel-sizes", "[2", "2]"], "invalid int value: '[2'"),
])
def test_context_parallel_communication_refused(capsys, flags, says):
    line = refused(capsys, *flags, world_size=4)
    assert says in line, line


PP2 = ["--pipeline-model-parallel-size", "2"]


def test_embedding_wgrad_deferral_accepted_with_a_pipeline():
    for extra in ([], ["--wgrad-deferral-limit", "2"], ["--wgrad-deferral-limit", "0"]):
        args = resolve(*PP2, "--defer-embedding-wgrad-compute", *extra, world_size=2)
        assert args.pipeline_model_parallel_size == 2 and not args.compat_warnings
    resolve("--wgrad-deferral-limit", "-1")  # megatron-core reads the limit only with deferral


@pytest.mark.parametrize("flags,says", [
    (["--defer-embedding-wgrad-compute"], "needs --pipeline-model-parallel-size > 1"),
    ([*PP2, "--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"],
     "defers the weight gradient only with gradient-accumulation fusion"),
    ([*PP2, "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "-1"],
     "--wgrad-deferral-limit -1 must be >= 0"),
])
def test_embedding_wgrad_deferral_refused(capsys, flags, says):
    line = refused(capsys, *flags, world_size=2)
    assert says in line, line


def test_distributed_optimizer_instances_accepted_with_one_warning():
    args = resolve("--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", world_size=4)
    lines = [w for w in args.compat_warnings if "--num-distributed-optimizer-instances 2" in w]
    assert len(lines) == 1 and "sharded over all 4" in lines[0] and "instead of Megatron-LM's 2/4" in lines[0]
    assert args.use_distributed_optimizer and args.data_parallel_size == 4
    one = resolve("--num-distributed-optimizer-instances", "1", world_size=4)  # the default: nothing to say
    assert not [w for w in one.compat_warnings if "instances" in w]


@pytest.mark.parametrize("flags,world,says", [
    (["--num-distributed-optimizer-instances", "2"], 4, "needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"], 3, "does not divide the 3"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "0"], 2, "must be >= 1"),
])
def test_distributed_optimizer_instances_refused(capsys, flags, world, says):
    line = refused(capsys, *flags, world_size=world)
    assert says in line, line


TP2 = ["--tensor-model-parallel-size", "2"]


def test_tp_comm_overlap_accepted_without_effect_with_sequence_parallelism():
    args = resolve(*TP2, "--sequence-parallel", "--tp-comm-overlap", world_size=2)
    lines = [w for w in args.compat_warnings if "--tp-comm-overlap" in w]
    assert len(lines) == 1 and "accepted without effect" in lines[0] and "userbuffers are not set up" in lines[0]


@pytest.mark.parametrize("flags", [[*TP2, "--tp-comm-overlap"], ["--sequence-parallel", "--tp-comm-overlap"]])
def test_tp_comm_overlap_needs_sequence_parallelism(capsys, flags):
    # TP = 1 turns --sequence-parallel off first, as in Megatron-LM
    line = refused(capsys, *flags, world_size=2)
    assert "--tp-comm-overlap needs --sequence-parallel" in line, line
