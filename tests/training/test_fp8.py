"""FP8 (``--fp8-format``, megatron/training/fp8.py): Megatron-LM's flags become megatron-core's
``TransformerConfig`` fields, in Transformer Engine's layers on a CUDA GPU; elsewhere one line.

What runs here (CPU, no TE): the parse as on this machine and as on a GPU node with TE
(``assume_hardware``, what ``tools/check_launch_script.py --cuda --te`` uses), Megatron-LM's
rules, and the config megatron-core receives. FP8 GEMMs themselves need a Hopper GPU with TE
(not run in this suite).
"""

import pytest
from conftest import parsed, refused_line

QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--lr", "1e-3", "--train-iters", "2",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


def on_gpu_node(*flags, world_size=1):
    """The driver's resolved args as on a CUDA node with Transformer Engine."""
    from megatron.training.arg_checks import assume_hardware

    with assume_hardware(True, True):
        return parsed(QUIET, *flags, world_size=world_size)


def test_fp8_is_refused_in_one_line_where_te_layers_do_not_build(capsys):
    line = refused_line(capsys, QUIET, *FP8)  # Megatron-LM's default spec, TE: missing here
    assert "--fp8-format: needs Transformer Engine's layers on a CUDA GPU" in line and "missing" in line
    line = refused_line(capsys, QUIET, *FP8, "--transformer-impl", "local")
    assert "--transformer-impl local has no FP8 GEMMs" in line


def test_fp8_reaches_megatron_cores_config_on_a_gpu_node():
    from megatron.training.model import transformer_config

    args = on_gpu_node(*FP8, "--fp8-margin", "1", "--fp8-amax-history-len", "16", "--no-fp8-wgrad",
                       "--fp8-param-gather", "--use-distributed-optimizer", "--first-last-layers-bf16", "--bf16",
                       world_size=2)
    assert args.transformer_impl == "transformer_engine"
    config = transformer_config(args, use_cpu=True)
    assert (config.fp8, config.fp8_recipe, config.fp8_margin, config.fp8_amax_history_len) == \
        ("hybrid", "tensorwise", 1, 16)
    assert config.fp8_param and not config.fp8_wgrad and config.first_last_layers_bf16
    assert config.num_layers_at_start_in_bf16 == config.num_layers_at_end_in_bf16 == 1
    plain = transformer_config(parsed(QUIET, "--transformer-impl", "local"), use_cpu=True)
    assert plain.fp8 is None and not plain.fp8_param  # no flag: megatron-core's defaults


@pytest.mark.parametrize("flags, says", [
    (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
    ([*FP8, "--fp8-param-gather"], "--fp8-param-gather needs --use-distributed-optimizer or FSDP"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "custom"], "--fp8-recipe custom needs --fp8-quantizer-factory"),
    (["--fp8-format", "e4m3", "--first-last-layers-bf16"], "delayed scaling keeps no layers in bf16"),
    ([*FP8, "--context-parallel-size", "2"], "this driver's context-parallel attention lives in the local spec"),
])
def test_fp8_rules_are_megatron_lms(capsys, flags, says):
    from megatron.training.arg_checks import assume_hardware

    with assume_hardware(True, True):
        line = refused_line(capsys, QUIET, *flags, world_size=2)
    assert says in line


def test_fp8_param_gather_with_torch_fsdp2_is_turned_off_with_one_warning():
    args = on_gpu_node(*FP8, "--fp8-param-gather", "--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                       world_size=2)
    assert not args.fp8_param_gather
    assert sum(w.startswith("--fp8-param-gather with --use-torch-fsdp2: turned off") for w in args.compat_warnings) == 1


def test_launch_check_marks_fp8_as_gpu_only():
    from megatron.training.launch_check import classify

    flags = [("--fp8-format", ["hybrid"]), ("--fp8-recipe", ["tensorwise"])]
    assert {r["status"] for r in classify(flags)} == {"hardware"}
    assert {r["status"] for r in classify(flags, cuda=True, te=True)} == {"honoured"}
    with_cp = classify([*flags, ("--context-parallel-size", ["2"])], cuda=True, te=True)
    assert [r["status"] for r in with_cp[:2]] == ["unsupported", "unsupported"]
    refused = classify([("--fp8-output-proj", [])], cuda=True, te=True)
    assert refused[0]["status"] == "unsupported" and "not wired" in refused[0]["reason"]
