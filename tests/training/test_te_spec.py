"""``--transformer-impl transformer_engine`` with sparse attention (issue 62 item 1).

Where TE runs, the layer spec is megatron-core's TE spec (fused LayerNorm-linear, TE's
linears) with SparseBalance's module in the core-attention slot; the dense path keeps TE's
own core attention (``--attention-backend`` picks its kernel, as in Megatron-LM). Where CUDA
or TE is missing (this machine), the same line trains with the local spec and one warning
line. TE's modules cannot be built here: the TE case builds the spec object only, with
megatron-core's spec provider (its TE classes are megatron-core's stand-ins without TE)
and the trainer's probes answering as on a GPU node with TE.
"""

import pytest
from conftest import PRETRAIN, TINY, summary_of

TE_SPARSE = ["--transformer-impl", "transformer_engine", "--sparse-balance", "--sb-cost-model", "h100-analytic",
             "--sb-block-size", "16", "--sb-topk", "2"]


def parse(argv, target=None):
    from megatron.training.arguments import parse_args
    from megatron.training.launch_verdict import Target, on_target

    with on_target(target or Target()):
        return parse_args(argv, world_size=1)


@pytest.fixture
def te_spec_provider(monkeypatch):
    """megatron-core's spec builder names ``TESpecProvider`` only where TE imports, and the
    provider asks TE's version (a recent TE stands in)."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(provider, "is_te_min_version", lambda version, check_equality=True: True)


def test_te_present_gives_tes_spec_with_our_core_attention(corpus, te_spec_provider):
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron.training.arg_checks import assume_hardware
    from megatron.training.launch_verdict import Target
    from megatron.training.model import layer_spec
    from sparsebalance.attention.sparse import SparseAttention

    gpu = Target(cuda=True, te=True)
    args = parse([*TINY, "--data-path", corpus, *TE_SPARSE], gpu)
    assert args.transformer_impl == "transformer_engine" and args.compat_warnings == []
    with assume_hardware(cuda=True, te=True):  # the layer spec asks the machine too (model._te_runs)
        spec = layer_spec(args)
    attention = spec.submodules.self_attention.submodules
    assert attention.core_attention.module is SparseAttention
    assert attention.core_attention.params["block_size"] == 16
    assert attention.linear_qkv is te.TELayerNormColumnParallelLinear  # the input norm fused in
    assert attention.linear_proj is te.TERowParallelLinear
    assert spec.submodules.input_layernorm is IdentityOp
    assert spec.submodules.mlp.submodules.linear_fc1 is te.TELayerNormColumnParallelLinear
    assert spec.submodules.mlp.submodules.linear_fc2 is te.TERowParallelLinear
    dense_args = parse([*TINY, "--data-path", corpus, "--transformer-impl", "transformer_engine",
                        "--attention-backend", "flash"], gpu)
    with assume_hardware(cuda=True, te=True):
        dense = layer_spec(dense_args)
    assert layer_spec(dense_args).submodules.self_attention.submodules.core_attention is not \
        te.TEDotProductAttention  # this CPU: the local spec, whatever the args say
    assert dense.submodules.self_attention.submodules.core_attention is te.TEDotProductAttention


def test_te_absent_gives_the_local_spec_and_one_warning(corpus):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron.training.model import layer_spec
    from sparsebalance.attention.sparse import SparseAttention

    args = parse([*TINY, "--data-path", corpus, *TE_SPARSE])
    assert args.transformer_impl == "local"
    te_lines = [w for w in args.compat_warnings if "transformer" in w.lower()]
    assert len(te_lines) == 1 and "without TE's fused LayerNorm-linear" in te_lines[0], args.compat_warnings
    attention = layer_spec(args).submodules.self_attention.submodules
    assert attention.core_attention.module is SparseAttention and attention.linear_qkv is ColumnParallelLinear


def test_te_line_with_sparse_balance_trains_on_cpu(corpus, world):
    proc = world.launch(PRETRAIN, [*TINY, "--data-path", corpus, *TE_SPARSE, "--train-iters", "2"], timeout=240)
    assert summary_of(proc)["iterations"] == 2
    warnings = [ln for ln in proc.stderr.splitlines() if "warning:" in ln and "transformer" in ln.lower()]
    assert len(warnings) == 1 and "--transformer-impl transformer_engine: CUDA" in warnings[0], proc.stderr
