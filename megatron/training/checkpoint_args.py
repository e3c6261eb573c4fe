"""``--use-checkpoint-args``: the model flags saved in the checkpoint under ``--load``.

Megatron-LM saves its whole argument namespace in every checkpoint (``args``: in
``common.pt`` of a torch_dist checkpoint, in ``mp_rank_00/model_optim_rng.pt`` of a legacy
``--ckpt-format torch`` one) and, with ``--use-checkpoint-args``, takes the model flags
from it before validating the command line (its ``load_args_from_checkpoint``), so a
continued-pretraining launch line can leave them out. This driver saves the model flags
of :data:`MODEL_ARGS` the same way (a plain dict) and reads either kind:

* a model flag the command line leaves out takes the checkpoint's value;
* one the command line gives with another value is refused in one line (Megatron-LM
  overwrites some silently and keeps the command line's for others; either way the
  weights would not fit, or the model would differ from the one trained);
* ``--seq-length`` and ``--max-position-embeddings`` stay the command line's when given
  (not weight shapes with RoPE: context extension changes them; Megatron-LM keeps the
  command line's too);
* an architecture this driver does not build (e.g. MoE, squared ReLU) is refused in one
  line. The dropout probabilities are the checkpoint's even when given (Megatron-LM forces
  them); a given value that differs gets one warning line.

A resume without ``--use-checkpoint-args`` (and without ``--finetune``) is checked too, where
either side has YaRN positions (:func:`changed_positions`): another position type or other
YaRN settings than the checkpoint's is one line (the weights would load and mean another model).

No checkpoint under ``--load``: the command line's flags with one warning (Megatron-LM
prints the same), or the ``--exit-on-missing-checkpoint`` error.
"""

from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional, Sequence

from megatron.training import yarn

MODEL_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
              "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
              "position_embedding_type", "rotary_base", "rotary_percent", "normalization", "norm_epsilon",
              "swiglu", "squared_relu", "apply_layernorm_1p", "qk_layernorm", "attention_output_gate",
              "rotary_interleaved", "add_qkv_bias", "disable_bias_linear", "untie_embeddings_and_output_weights",
              "padded_vocab_size", "hidden_dropout", "attention_dropout", "multi_latent_attention", "q_lora_rank",
              "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "use_mup",
              "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
              "mup_attn_scale_power", *yarn.DEFAULTS)
"""Flags (argparse dests) saved as the checkpoint's ``args`` and read back (the YaRN ones
resolved under yarn, None otherwise for those with a ``yarn_`` prefix)."""
COMMAND_LINE_WINS = ("seq_length", "max_position_embeddings")
"""Read from the checkpoint only when the command line leaves them out."""
CHECKPOINT_WINS = ("hidden_dropout", "attention_dropout")
"""The checkpoint's value replaces a given one (Megatron-LM's ``_set_arg(..., force=True)``)."""
UNSUPPORTED = {"num_experts": "mixture of experts", "mtp_num_layers": "multi-token prediction"}
"""Megatron-LM namespace entries (truthy) naming a model this driver does not build."""


def saved_args(args: argparse.Namespace) -> Dict[str, object]:
    """The run's model flags as the checkpoint stores them (``padded_vocab_size``: the
    embedding rows the run built)."""
    return {name: getattr(args, name, None) for name in MODEL_ARGS}


def _from_megatron_lm(ns: argparse.Namespace) -> Dict[str, object]:
    """Megatron-LM's namespace in this driver's dests (its ``add_bias_linear`` is the
    inverse of ``--disable-bias-linear``; its ``num_query_groups`` counts only with
    ``group_query_attention``)."""
    out = {name: getattr(ns, name) for name in MODEL_ARGS if hasattr(ns, name)}
    if not getattr(ns, "group_query_attention", False):  # its num_query_groups (default 1) is unused then
        out["num_query_groups"] = None
    if hasattr(ns, "add_bias_linear"):
        out["disable_bias_linear"] = not ns.add_bias_linear
    return out


def _checkpoint_file(load: str) -> Optional[str]:
    """The file holding ``args`` in the newest checkpoint under ``load`` (None: none)."""
    from megatron.training.checkpointing import iter_dir, read_tracker
    from megatron.training.legacy_checkpoint import legacy_file

    iteration = read_tracker(load)
    if iteration is None:
        return None
    path = iter_dir(load, iteration)
    common = os.path.join(path, "common.pt")
    if os.path.isfile(common):
        return common
    return legacy_file(path, tp_rank=0, pp_rank=0, pp=None)


def read_checkpoint_args(load: str) -> Optional[Dict[str, object]]:
    """Model flags saved in the newest checkpoint under ``load`` (None: no checkpoint);
    ValueError (one line) when it has none or they cannot be read."""
    import torch

    file = _checkpoint_file(load)
    if file is None:
        return None
    try:  # Megatron-LM pickles an argparse.Namespace: not a weights-only file
        saved = torch.load(file, map_location="cpu", weights_only=False, mmap=True).get("args")
    except (OSError, RuntimeError, AttributeError, ValueError) as e:
        raise ValueError(f"--use-checkpoint-args: cannot read {file}: {' '.join(str(e).split())[:200]}") from None
    if isinstance(saved, argparse.Namespace):
        bad = [what for name, what in UNSUPPORTED.items() if getattr(saved, name, None)]
        if bad:
            raise ValueError(f"--use-checkpoint-args: the checkpoint in {load} is a model with {bad[0]}, "
                             "which this driver does not build")
        return _from_megatron_lm(saved)
    if isinstance(saved, dict):
        return {k: v for k, v in saved.items() if k in MODEL_ARGS}
    raise ValueError(f"--use-checkpoint-args: {file} holds no model flags (args); pass them on the command line")


def explicit_dests(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> List[str]:
    """The dests the command line ``argv`` sets itself (not by default)."""
    import copy

    quiet = copy.deepcopy(parser)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    # A --model-preset's values count as given: the command line named the preset.
    return sorted(vars(quiet.parse_known_args(argv)[0]))


def apply_checkpoint_args(args: argparse.Namespace, given: Sequence[str], warn) -> None:
    """Fill ``args``' model flags from the checkpoint under ``--load`` (module docstring);
    ``given``: dests set on the command line. ValueError (one line) on a mismatch."""
    if args.load is None:
        warn("--use-checkpoint-args without --load: no checkpoint to read model flags from")
        return
    saved = read_checkpoint_args(args.load)
    if saved is None:
        if not args.exit_on_missing_checkpoint:  # that flag's own error follows
            warn(f"--use-checkpoint-args: no checkpoint in {args.load}; using the command line's model flags")
        return
    for name in MODEL_ARGS:
        if name not in saved or saved[name] is None:
            continue
        value = saved[name]
        if name in given and getattr(args, name) != value:
            if name in COMMAND_LINE_WINS:
                continue
            if name in CHECKPOINT_WINS:
                warn(f"--use-checkpoint-args: --{name.replace('_', '-')} {value} from the checkpoint replaces the "
                     f"command line's {getattr(args, name)} (as in Megatron-LM)")
                setattr(args, name, value)
                continue
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"--use-checkpoint-args: {flag} {getattr(args, name)} on the command line, but the "
                             f"checkpoint in {args.load} was trained with {value!r}: drop the flag or make it match")
        setattr(args, name, value)


def _positions(values: Dict[str, object]) -> Dict[str, object]:
    kind = values.get("position_embedding_type")
    return {"position_embedding_type": kind, **(yarn.resolved(values) if kind == "yarn" else {})}


def changed_positions(saved: object, now: Dict[str, object]) -> Optional[str]:
    """What a resume changes in the positions when the checkpoint's (``saved``: its ``args``,
    this driver's dict or Megatron-LM's namespace; None: not recorded) or the run's (``now``:
    :func:`saved_args`) are YaRN: ``--flag value (the checkpoint's: value)`` for each
    difference, or None (nothing changed, nothing recorded, or neither is YaRN)."""
    if isinstance(saved, argparse.Namespace):
        saved = _from_megatron_lm(saved)
    if not isinstance(saved, dict) or saved.get("position_embedding_type") is None:
        return None
    was, is_ = _positions(saved), _positions(now)
    if "yarn" not in (was["position_embedding_type"], is_["position_embedding_type"]):
        return None
    keys = ["position_embedding_type"] if was.keys() != is_.keys() else [k for k in was if was[k] != is_[k]]
    if not keys:
        return None
    return ", ".join(f"--{k.replace('_', '-')} {is_.get(k)} (the checkpoint's: {was.get(k)})" for k in keys)
