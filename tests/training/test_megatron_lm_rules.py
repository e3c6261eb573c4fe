"""Megatron-LM's ``parse_args`` + ``validate_args`` (main, d98e8a64) rule by rule: the
configuration ``pretrain_gpt.py`` resolves equals Megatron-LM's (parse only, no training).

The expected values are written from Megatron-LM's source: ``megatron/training/arguments.py``
(``validate_args``), ``megatron/core/transformer/transformer_config.py`` (defaults),
``megatron/training/config/training_config.py`` and ``pretrain_gpt.py``. docs/usage.md's
table lists each rule beside this driver's behaviour.
"""

import math

import pytest

from megatron.training.arg_checks import assume_hardware
from megatron.training.arguments import parse_args

# the defaults not under test, passed so that their warnings stay out of the way
QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local"]


def resolve(*flags, world_size=1):
    return parse_args([*QUIET, *flags], world_size=world_size)


def refused(capsys, *flags, world_size=1, base=QUIET):
    """The one error line of a refused command line."""
    with pytest.raises(SystemExit) as e:
        parse_args([*base, *flags], world_size=world_size)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def warned(args, text):
    return [w for w in args.compat_warnings if text in w]


# --- positions -------------------------------------------------------------------------

def test_no_position_embedding_with_rope_is_rope():
    # add_position_embedding=False only drops learned absolute embeddings; rope stays
    args = resolve("--no-position-embedding", "--position-embedding-type", "rope")
    assert args.position_embedding_type == "rope"
    from megatron.training.checkpoint_args import saved_args

    assert saved_args(args)["position_embedding_type"] == "rope"  # what the checkpoint records


@pytest.mark.parametrize("extra", [[], ["--position-embedding-type", "learned_absolute"],
                                   ["--position-embedding-type", "none"]])
def test_no_position_embedding_without_rope_is_refused(capsys, extra):
    # RuntimeError('--no-position-embedding is deprecated, use --position-embedding-type')
    line = refused(capsys, "--no-position-embedding", *extra)
    assert "--no-position-embedding is deprecated, use --position-embedding-type" in line


def test_use_rotary_position_embeddings_is_rope():
    assert resolve("--use-rotary-position-embeddings").position_embedding_type == "rope"
    assert resolve().position_embedding_type == "learned_absolute"


YARN_CONFIG = {"yarn_rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": 4096,
               "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 0.0,
               "yarn_correction_range_round_to_int": True}
"""Megatron-LM main's config attributes for ``--position-embedding-type yarn`` alone
(argument_utils._apply_yarn_config_from_args: the flags' defaults, YarnRotaryEmbedding's)."""


def test_yarn_defaults_reach_the_config():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    from megatron.training.checkpoint_args import saved_args
    from megatron.training.model import transformer_config

    args = resolve("--position-embedding-type", "yarn")
    config = transformer_config(args, use_cpu=True)
    assert {k: getattr(config, k) for k in YARN_CONFIG} == YARN_CONFIG
    assert not args.compat_warnings
    saved = saved_args(args)  # the resolved values are what the checkpoint records
    assert (saved["position_embedding_type"], saved["yarn_beta_fast"], saved["yarn_original_max_position_embeddings"],
            saved["yarn_correction_range_round_to_int"]) == ("yarn", 32.0, 4096, True)
    given = resolve("--position-embedding-type", "yarn", "--rotary-scaling-factor", "4", "--yarn-beta-fast", "16",
                    "--yarn-beta-slow", "2", "--yarn-original-max-position-embeddings", "32768", "--mscale", "0.8",
                    "--mscale-all-dim", "0.5", "--no-yarn-correction-range-round-to-int")
    config = transformer_config(given, use_cpu=True)
    assert {k: getattr(config, k) for k in YARN_CONFIG} == {
        "yarn_rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 32768, "yarn_beta_fast": 16.0,
        "yarn_beta_slow": 2.0, "yarn_mscale": 0.8, "yarn_mscale_all_dim": 0.5,
        "yarn_correction_range_round_to_int": False}
    # the factor every attention layer multiplies cos/sin by: m(s, mscale) / m(s, mscale_all_dim)
    want = (0.1 * 0.8 * math.log(4) + 1) / (0.1 * 0.5 * math.log(4) + 1)
    assert _yarn_get_concentration_factor_from_config(config) == pytest.approx(want, rel=1e-15)
    # other positions carry none of the attributes: the attention layers apply no factor
    assert not hasattr(transformer_config(resolve("--position-embedding-type", "rope"), use_cpu=True),
                       "yarn_rotary_scaling_factor")


def test_yarn_flags_without_yarn_warn_once():
    args = resolve("--position-embedding-type", "rope", "--yarn-beta-fast", "16", "--rotary-scaling-factor", "4")
    assert len(warned(args, "accepted without effect: --yarn-beta-fast --rotary-scaling-factor")) == 1
    assert args.yarn_beta_fast == 16.0 and args.yarn_beta_slow is None  # not resolved: no YaRN
    assert not resolve("--mscale", "1.0").compat_warnings  # Megatron-LM's default value


@pytest.mark.parametrize("flags,says", [
    (["--rotary-interleaved"], "--rotary-interleaved: megatron-core's YaRN rotates the two halves"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: megatron-core's YaRN ignores it"),
    (["--rotary-seq-len-interpolation-factor", "2"], "--rotary-seq-len-interpolation-factor 2: megatron-core"),
    (["--use-rope-scaling"], "--use-rope-scaling: megatron-core's YaRN ignores it"),
    (["--original-max-position-embeddings", "8192"], "GPT YaRN's original context is "
                                                      "--yarn-original-max-position-embeddings (now 4096)"),
    (["--rotary-scaling-factor", "2.718281828459045", "--mscale", "-20"], "attention factor of -1; it must be > 0"),
    (["--rotary-scaling-factor", "0"], "--rotary-scaling-factor: must be > 0"),
    (["--yarn-beta-slow", "-1"], "--yarn-beta-slow: must be > 0"),
])
def test_yarn_bad_combinations_are_one_line(capsys, flags, says):
    line = refused(capsys, "--position-embedding-type", "yarn", *flags)
    assert says in line, line


def test_yarn_context_parallel_needs_an_original_context_divisible_by_2cp(capsys):
    # megatron-core's YaRN caches cos/sin over the original context, cut in 2 x CP chunks
    line = refused(capsys, "--position-embedding-type", "yarn", "--yarn-original-max-position-embeddings", "30",
                   "--context-parallel-size", "2", world_size=2)
    assert "needs it divisible by 2 x CP = 4" in line
    assert resolve("--position-embedding-type", "yarn", "--context-parallel-size", "2",
                   world_size=2).yarn_original_max_position_embeddings == 4096


def test_original_max_position_embeddings_with_yarn():
    # branch dev's flag is multi-latent attention's: GPT YaRN takes it only where it agrees
    args = resolve("--position-embedding-type", "yarn", "--original-max-position-embeddings", "8192",
                   "--yarn-original-max-position-embeddings", "8192")
    assert args.yarn_original_max_position_embeddings == 8192 and not args.compat_warnings
    assert not resolve("--original-max-position-embeddings", "8192").compat_warnings  # a no-op without YaRN


def test_rope_type(capsys):
    # Megatron-LM asserts rope_type "rope" without multi-latent attention
    assert resolve("--rope-type", "rope").position_embedding_type == "learned_absolute"
    assert "YaRN on the GPT layers is --position-embedding-type yarn" in refused(capsys, "--rope-type", "yarn")


# --- dropout -----------------------------------------------------------------------------

def test_dropout_defaults_reach_the_model():
    from megatron.training.model import transformer_config

    args = resolve()
    assert (args.hidden_dropout, args.attention_dropout) == (0.1, 0.1)  # TransformerConfig's defaults
    config = transformer_config(args, use_cpu=True)
    assert (config.hidden_dropout, config.attention_dropout) == (0.1, 0.1)
    config = transformer_config(resolve("--hidden-dropout", "0", "--attention-dropout", "0.2"), use_cpu=True)
    assert (config.hidden_dropout, config.attention_dropout) == (0.0, 0.2)


def test_attention_dropout_with_sparse_attention_is_refused_when_given(capsys):
    """The sparse kernels apply no attention dropout: a value the line sets is refused; a line
    that leaves it out (Megatron-LM's default 0.1) trains with 0 and says so once."""
    line = refused(capsys, "--sparse-attention", "--attention-dropout", "0.1")
    assert "--attention-dropout 0.1" in line and "pass --attention-dropout 0" in line
    assert resolve("--sparse-attention", "--attention-dropout", "0").sparse_attention
    for switch in ("--sparse-attention", "--sparse-balance"):
        args = resolve(switch, *(["--sb-cost-model", "h100-analytic"] if switch == "--sparse-balance" else []))
        assert args.attention_dropout == 0.0 and args.hidden_dropout == 0.1
        assert sum("--attention-dropout not given" in w for w in args.compat_warnings) == 1
    assert resolve().attention_dropout == 0.1  # dense attention keeps Megatron-LM's default


# --- MLP and attention shape ---------------------------------------------------------------

@pytest.mark.parametrize("hidden", [64, 128, 896, 4096])
def test_swiglu_ffn_size(hidden):
    heads = ["--num-attention-heads", "4"]
    args = resolve("--swiglu", "--hidden-size", str(hidden), *heads)
    assert args.ffn_hidden_size == int((4 * hidden * 2 / 3) / 64) * 64
    assert resolve("--hidden-size", str(hidden), *heads).ffn_hidden_size == 4 * hidden
    assert resolve("--swiglu", "--hidden-size", str(hidden), "--ffn-hidden-size", "100", *heads).ffn_hidden_size == 100


def test_num_query_groups_needs_group_query_attention():
    from megatron.training.model import transformer_config

    plain = resolve("--num-attention-heads", "4", "--num-query-groups", "2")
    assert plain.num_query_groups is None
    assert transformer_config(plain, use_cpu=True).num_query_groups == 4  # one group per head
    grouped = resolve("--num-attention-heads", "4", "--num-query-groups", "2", "--group-query-attention")
    assert transformer_config(grouped, use_cpu=True).num_query_groups == 2
    assert resolve("--group-query-attention").num_query_groups == 1  # --num-query-groups' default


def test_kv_channels_default():
    from megatron.training.model import transformer_config

    args = resolve("--hidden-size", "96", "--num-attention-heads", "4")
    assert transformer_config(args, use_cpu=True).kv_channels == 24  # hidden / heads


# --- data and evaluation -------------------------------------------------------------------

def test_split_default_with_data_path_warns(tmp_path):
    import numpy as np

    from megatron.training.indexed_io import write_documents

    prefix = str(tmp_path / "d")
    write_documents(prefix, [np.arange(10)] * 4, 256)
    base = ["--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local", "--data-path", prefix]
    args = parse_args(base, world_size=1)
    assert args.split == "969, 30, 1" and len(warned(args, "--data-path without --split")) == 1
    assert args.split_fractions == pytest.approx((0.969, 0.030, 0.001))
    args = parse_args([*base, "--split", "90,10,0"], world_size=1)
    assert args.split == "90,10,0" and not warned(args, "--split")
    assert not warned(resolve(), "--split")  # --mock-data: no data path, no warning


def test_eval_iters_default_and_negative():
    assert resolve().eval_iters == 100  # ValidationConfig.eval_iters
    args = resolve("--eval-iters", "-1", "--eval-interval", "5")
    assert args.eval_iters == -1 and len(warned(args, "no evaluation")) == 1
    assert not warned(resolve("--eval-iters", "-1"), "no evaluation")  # nothing to surprise


# --- attention backend and layer implementation ----------------------------------------------

def test_use_flash_attn_changes_nothing():
    args = resolve("--use-flash-attn")
    assert args.attention_backend == "auto" and not args.compat_warnings


def test_transformer_engine_default_falls_back_once():
    with assume_hardware(cuda=False, te=False):
        args = parse_args(["--mock-data", "--tokenizer-type", "ByteTokenizer"], world_size=1)
    assert args.transformer_impl == "local"
    assert len(warned(args, "--transformer-impl transformer_engine")) == 1 and len(args.compat_warnings) == 1
    with assume_hardware(cuda=True, te=True):
        assert parse_args(["--mock-data", "--tokenizer-type", "ByteTokenizer"],
                          world_size=1).transformer_impl == "transformer_engine"
        # the TE spec carries the sparse attention in its core-attention slot
        sparse = parse_args(["--mock-data", "--tokenizer-type", "ByteTokenizer", "--sparse-balance",
                             "--sb-cost-model", "h100-analytic"], world_size=1)
        assert sparse.transformer_impl == "transformer_engine" and not warned(sparse, "--transformer-impl")
        cp = parse_args(["--mock-data", "--tokenizer-type", "ByteTokenizer", "--context-parallel-size", "2"],
                        world_size=2)
        assert cp.transformer_impl == "local" and warned(cp, "context-parallel attention lives in the local spec")


def test_attention_backend_flash_on_the_local_spec_warns():
    args = resolve("--attention-backend", "flash")
    assert args.attention_backend == "flash" and len(warned(args, "--attention-backend flash")) == 1


def test_tokenizer_default_is_gpt2_bpe(tmp_path):
    files = ["--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")]
    base = ["--mock-data", "--transformer-impl", "local"]
    assert parse_args([*base, *files], world_size=1).tokenizer_type == "GPT2BPETokenizer"
    args = parse_args(base, world_size=1)  # Megatron-LM stops here (no vocabulary): one warning instead
    assert args.tokenizer_type == "ByteTokenizer" and len(warned(args, "GPT2BPETokenizer")) == 1


# --- checkpoints ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--no-load-optim", "--no-load-rng", "--exit-on-missing-checkpoint"])
def test_load_flags_without_load_are_ignored(flag):
    args = resolve(flag)
    assert args.load is None
    assert len(warned(args, "training starts from scratch")) == (flag == "--exit-on-missing-checkpoint")


def test_finetune_without_load_is_ignored_with_one_warning():
    args = resolve("--finetune")
    assert args.finetune and args.load is None
    assert len(warned(args, "--finetune without --load")) == 1


def test_save_retain_interval_is_a_multiple_of_save_interval(capsys, tmp_path):
    line = refused(capsys, "--save", str(tmp_path), "--save-interval", "4", "--save-retain-interval", "6")
    assert "not a multiple of --save-interval 4" in line


# --- schedule ------------------------------------------------------------------------------

def test_warmup_longer_than_training_is_accepted():
    args = resolve("--train-iters", "50", "--lr-decay-iters", "320000", "--lr-warmup-fraction", "0.01")
    assert args.train_iters == 50 and len(warned(args, "the LR warmup (3200 iterations) is longer")) == 1


def test_schedule_rules(capsys):
    assert "--lr-warmup-fraction or --lr-warmup-iters" in refused(
        capsys, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5")
    assert "give --train-iters or --train-samples" in refused(capsys, "--train-iters", "5", "--train-samples", "5")
    assert "--min-lr 0.1 is larger than --lr" in refused(capsys, "--lr", "0.01", "--min-lr", "0.1")


def test_weight_decay_constant_style_uses_weight_decay():
    args = resolve("--weight-decay", "0.05")
    from megatron.training.lr_schedule import scheduler_kwargs

    kw = scheduler_kwargs(args)
    assert kw["start_wd"] == kw["end_wd"] == 0.05


# --- parallelism ---------------------------------------------------------------------------

def test_global_batch_default_and_sequence_parallel_off_with_tp1():
    args = resolve("--micro-batch-size", "2", world_size=2)
    assert args.global_batch_size == 4  # micro-batch size x DP
    assert not resolve("--sequence-parallel").sequence_parallel


def test_recompute_rules(capsys):
    assert resolve("--recompute-activations").recompute_granularity == "selective"
    args = resolve("--recompute-num-layers", "1")  # without a granularity Megatron-LM recomputes nothing
    assert args.recompute_granularity is None and args.recompute_num_layers is None
    assert len(warned(args, "nothing is recomputed")) == 1
    assert "takes no --recompute-method" in refused(capsys, "--recompute-activations", "--recompute-method", "block")


def test_overlap_param_gather_rules(capsys):
    assert "only supported with --use-distributed-optimizer" in refused(capsys, "--overlap-param-gather")
    assert "needs --overlap-grad-reduce" in refused(capsys, "--overlap-param-gather", "--use-distributed-optimizer")


def test_interleaved_microbatch_group(capsys):
    pp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
          "--untie-embeddings-and-output-weights", "--global-batch-size", "3"]
    line = refused(capsys, *pp, world_size=2)
    assert "M % group must be 0 or >= pp" in line  # megatron-core's, group = PP by default
    args = resolve(*pp, "--microbatch-group-size-per-virtual-pipeline-stage", "3", world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2 and args.microbatch_group_size_per_vp_stage == 3


# --- precision and determinism ---------------------------------------------------------------

def test_fp16_dynamic_loss_scaling_turns_off_the_nan_check():
    with assume_hardware(cuda=True, te=False):
        assert not resolve("--fp16").check_for_nan_in_loss_and_grad
        assert resolve("--fp16", "--loss-scale", "1024").check_for_nan_in_loss_and_grad
    assert resolve().check_for_nan_in_loss_and_grad


def test_deterministic_mode_rules(capsys):
    assert "Megatron-LM requires the loss unfused" in refused(
        capsys, "--deterministic-mode", "--cross-entropy-loss-fusion")
    with assume_hardware(cuda=True, te=True):
        assert resolve("--deterministic-mode").deterministic_mode  # dense attention: honoured
        line = refused(capsys, "--deterministic-mode", "--sparse-attention", "--attention-dropout", "0")
    assert "sparse attention kernels are not deterministic" in line
