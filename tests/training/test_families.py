"""Megatron-LM flag families honoured with Megatron-LM's meaning (megatron/training/families.py):
expert tensor-parallel groups, FSDP trained as DDP (one warning), multi-latent attention
(megatron-core's MLA), and tied embeddings over pipeline stages on CPU.

Rules are written from Megatron-LM main's ``validate_args`` and ``core_transformer_config_from_args``
(read, not copied): ETP defaults to TP; Megatron FSDP (v1) takes the distributed optimizer and
needs ``--ckpt-format fsdp_dtensor``; torch FSDP2 refuses PP > 1, the distributed optimizer and
tied embeddings; MLA excludes GQA and its config's rope_type is yarn unless given.
"""

import math

import pytest
from conftest import PRETRAIN, TINY, parsed, refused_line, summary_of

QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local", "--lr", "1e-3",
         "--train-iters", "2", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "128"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]


def test_expert_tensor_parallel_size_defaults_to_tp_and_forms_groups_only():
    assert parsed(QUIET, "--tensor-model-parallel-size", "2", world_size=4).expert_tensor_parallel_size == 2
    args = parsed(QUIET, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--untie-embeddings-and-output-weights", "--expert-tensor-parallel-size", "4", world_size=8)
    assert args.expert_tensor_parallel_size == 4 and not args.compat_warnings


def test_expert_tensor_parallel_size_must_divide_the_world(capsys):
    line = refused_line(capsys, QUIET, "--expert-tensor-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                        "--untie-embeddings-and-output-weights", world_size=4)
    assert "world size 4 is not divisible by --expert-tensor-parallel-size x PP = 4 x 2" in line


def test_megatron_fsdp_trains_as_ddp_with_the_distributed_optimizer():
    args = parsed(QUIET, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                  "--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "fp32", world_size=2)
    assert args.use_distributed_optimizer and args.ckpt_format == "torch_dist"
    said = [w for w in args.compat_warnings if w.startswith("--use-megatron-fsdp")]
    assert len(said) == 1 and "memory only" in said[0] and "torch_dist, not fsdp_dtensor" in said[0]


@pytest.mark.parametrize("flags, says", [
    (["--use-megatron-fsdp", "--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "fp32"],
     "--use-megatron-fsdp requires --ckpt-format fsdp_dtensor"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], "--megatron-fsdp-main-grads-dtype auto: with "
                                                                "--use-megatron-fsdp only fp32 is implemented"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--use-distributed-optimizer"],
     "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"),
    (["--use-torch-fsdp2", "--use-megatron-fsdp"], "give --use-megatron-fsdp or --use-torch-fsdp2, not both"),
])
def test_fsdp_rules_are_megatron_lms(capsys, flags, says):
    assert says in refused_line(capsys, QUIET, *flags, world_size=2)


def test_torch_fsdp2_trains_as_plain_ddp():
    args = parsed(QUIET, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights", world_size=2)
    assert not args.use_distributed_optimizer
    assert sum(w.startswith("--use-torch-fsdp2: trained as DDP") for w in args.compat_warnings) == 1


def test_mla_config_is_megatron_cores_with_megatron_lms_defaults():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron.training.model import transformer_config

    config = transformer_config(parsed(QUIET, *MLA), use_cpu=True)
    assert isinstance(config, MLATransformerConfig)
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim,
            config.v_head_dim) == (48, 16, 16, 8, 16)
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 1.0  # Megatron-LM's defaults
    assert transformer_config(parsed(QUIET, *MLA, "--rope-type", "rope"), use_cpu=True).rope_type == "rope"


@pytest.mark.parametrize("flags, says", [
    ([*MLA, "--group-query-attention"], "--group-query-attention and --multi-latent-attention exclude each other"),
    ([*MLA, "--sparse-attention"], "--multi-latent-attention with sparse attention is not supported"),
    (["--rope-type", "yarn"], "--rope-type yarn picks multi-latent attention's RoPE"),
])
def test_mla_refusals_are_one_line(capsys, flags, says):
    assert says in refused_line(capsys, QUIET, *flags)


def test_mla_trains_and_the_checkpoint_records_it(world, corpus, tmp_path):
    from megatron.training.checkpoint_args import read_checkpoint_args

    save = str(tmp_path / "ckpt")
    s = summary_of(world.launch(PRETRAIN, [*TINY, *MLA, "--data-path", corpus, "--train-iters", "3", "--save", save]))
    assert s["iterations"] == 3 and all(math.isfinite(x) for x in s["losses"])
    assert s["losses"][-1] < s["losses"][0]
    saved = read_checkpoint_args(save)
    assert saved["multi_latent_attention"] and (saved["kv_lora_rank"], saved["v_head_dim"]) == (16, 16)


def test_tied_embeddings_over_pipeline_stages_train_on_cpu(world, corpus, tmp_path):
    """Megatron-LM's default (tied) with PP 2: the last stage's output weight is the first
    stage's embedding and both get the summed gradient. From one checkpoint (initial weights
    depend on which layers a rank builds), PP 2's losses equal PP 1's, the second step's too."""
    tied = [f for f in TINY if f != "--untie-embeddings-and-output-weights"]
    assert len(tied) == len(TINY) - 1
    base = [*tied, "--data-path", corpus]
    save = str(tmp_path / "ckpt")
    assert summary_of(world.launch(PRETRAIN, [*base, "--train-iters", "1", "--save", save]))["iterations"] == 1
    runs = [summary_of(world.launch(PRETRAIN, [*base, "--train-iters", "2", "--load", save, "--finetune", *extra],
                                    nproc=nproc))
            for nproc, extra in ((1, []), (2, ["--pipeline-model-parallel-size", "2"]))]
    assert len(runs[1]["losses"]) == 2 and all(math.isfinite(x) for x in runs[1]["losses"])
    assert runs[1]["losses"] == pytest.approx(runs[0]["losses"], rel=1e-5)
