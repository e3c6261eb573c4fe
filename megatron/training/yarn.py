"""YaRN positions (``--position-embedding-type yarn``): Megatron-LM's flags, defaults and rules,
and the mapping to and from Hugging Face's ``rope_scaling`` of type yarn.

megatron-core builds the model: ``GPTModel``'s ``yarn`` branch makes a ``YarnRotaryEmbedding``
from ``yarn_*`` attributes of the ``TransformerConfig`` (not dataclass fields), and every
attention layer multiplies the cos / sin of RoPE by the concentration factor it computes from
three of them (``_yarn_get_concentration_factor_from_config``). Megatron-LM main sets those
attributes after building the config, from these flags (its ``_apply_yarn_config_from_args``);
:func:`apply_to_config` does the same here:

=========================================  =========================================  =======
flag                                       config attribute                           default
=========================================  =========================================  =======
``--rotary-scaling-factor``                ``yarn_rotary_scaling_factor``             1.0
``--yarn-original-max-position-embeddings``  ``yarn_original_max_position_embeddings``  4096
``--yarn-beta-fast``                       ``yarn_beta_fast``                         32.0
``--yarn-beta-slow``                       ``yarn_beta_slow``                         1.0
``--mscale``                               ``yarn_mscale``                            1.0
``--mscale-all-dim``                       ``yarn_mscale_all_dim``                    0.0
``--yarn-correction-range-round-to-int``   ``yarn_correction_range_round_to_int``     True
=========================================  =========================================  =======

Three of them have no ``yarn-`` prefix: Megatron-LM declares them with multi-latent attention,
whose YaRN reads them too. The concentration factor (HF's ``attention_factor``) is
``m(s, mscale) / m(s, mscale_all_dim)`` with ``m(s, x) = 0.1 x ln(s) + 1`` for ``s > 1``, else 1.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional

DEFAULTS: Dict[str, object] = {
    "rotary_scaling_factor": 1.0,
    "yarn_original_max_position_embeddings": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}
"""argparse dest -> Megatron-LM's value when the flag is left out."""
CONFIG_ATTR = {"rotary_scaling_factor": "yarn_rotary_scaling_factor", "mscale": "yarn_mscale",
               "mscale_all_dim": "yarn_mscale_all_dim"}
"""dests whose ``TransformerConfig`` attribute is not the dest itself."""
YARN_ONLY = tuple(d for d in DEFAULTS if d.startswith("yarn_"))
"""dests whose parser default is None (filled with :data:`DEFAULTS` only under yarn, as Megatron-LM)."""


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def resolved(values: Mapping[str, object]) -> Dict[str, object]:
    """The YaRN settings of ``values`` (an args dict or a checkpoint's saved flags), None filled
    with :data:`DEFAULTS`."""
    out = {}
    for dest, default in DEFAULTS.items():
        v = values.get(dest)
        out[dest] = default if v is None else v
    return out


def of_args(args) -> Dict[str, object]:
    """:func:`resolved` of an ``argparse.Namespace``."""
    return resolved({d: getattr(args, d, None) for d in DEFAULTS})


def fill_defaults(args) -> None:
    """Under ``--position-embedding-type yarn``, the flags left out take Megatron-LM's defaults
    (the resolved config and the checkpoint then record the values the model uses)."""
    if args.position_embedding_type == "yarn":
        for dest, value in of_args(args).items():
            setattr(args, dest, value)


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def attention_factor(values: Mapping[str, object]) -> float:
    """The factor megatron-core multiplies cos and sin by (``_yarn_get_concentration_factor``):
    ``m(s, mscale) / m(s, mscale_all_dim)``; ValueError when it is not a positive number."""
    v = resolved(values)
    s = float(v["rotary_scaling_factor"])
    den = _mscale(s, float(v["mscale_all_dim"]))
    if den == 0:
        raise ValueError(f"--mscale-all-dim {v['mscale_all_dim']} with --rotary-scaling-factor {s:g} makes YaRN's "
                         "attention factor divide by zero")
    factor = _mscale(s, float(v["mscale"])) / den
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"--mscale {v['mscale']} / --mscale-all-dim {v['mscale_all_dim']} give YaRN an attention "
                         f"factor of {factor:g}; it must be > 0")
    return factor


def validate(args, original_max_position_embeddings: Optional[str] = None) -> List[str]:
    """Megatron-LM's YaRN rules and this driver's refusals (ValueError, one line); returns
    warning lines. ``original_max_position_embeddings``: the value text of branch dev's
    ``--original-max-position-embeddings`` when given (multi-latent attention's; GPT YaRN
    does not read it)."""
    if args.position_embedding_type != "yarn":
        given = [flag(d) for d in YARN_ONLY if getattr(args, d, None) is not None]
        given += [flag(d) for d in CONFIG_ATTR if getattr(args, d) != DEFAULTS[d]]
        if not given:
            return []
        return [f"accepted without effect: {' '.join(given)} (read only with --position-embedding-type yarn; "
                "Megatron-LM reads them for YaRN and multi-latent attention positions)"]
    # megatron-core's YarnRotaryEmbedding asserts the first; it ignores the others, which
    # would train another model than the line asks for
    if args.rotary_interleaved:
        raise ValueError("--position-embedding-type yarn with --rotary-interleaved: megatron-core's YaRN rotates "
                         "the two halves of each head only (Megatron-LM stops on its assertion)")
    for bad, why in ((args.rotary_percent != 1.0, f"--rotary-percent {args.rotary_percent:g}"),
                     (args.rotary_seq_len_interpolation_factor is not None,
                      f"--rotary-seq-len-interpolation-factor {args.rotary_seq_len_interpolation_factor}"),
                     (args.use_rope_scaling, "--use-rope-scaling")):
        if bad:
            raise ValueError(f"--position-embedding-type yarn with {why}: megatron-core's YaRN ignores it "
                             "(every head dim rotated, frequencies set by the --yarn-* flags, "
                             "--rotary-scaling-factor, --mscale and --mscale-all-dim); drop it")
    v = of_args(args)
    cp = getattr(args, "context_parallel_size", 1)
    if cp > 1 and v["yarn_original_max_position_embeddings"] % (2 * cp):
        # its constructor caches cos/sin over the original context, cut in 2 x CP equal chunks
        raise ValueError(f"--yarn-original-max-position-embeddings {v['yarn_original_max_position_embeddings']} "
                         f"with --context-parallel-size {cp}: megatron-core's YaRN needs it divisible by "
                         f"2 x CP = {2 * cp}")
    if original_max_position_embeddings is not None and \
            _number(original_max_position_embeddings) != v["yarn_original_max_position_embeddings"]:
        raise ValueError(f"--original-max-position-embeddings {original_max_position_embeddings} with "
                         "--position-embedding-type yarn: Megatron-LM reads it only for multi-latent attention; "
                         "GPT YaRN's original context is --yarn-original-max-position-embeddings (now "
                         f"{v['yarn_original_max_position_embeddings']}): give that instead")
    attention_factor(v)
    return []


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def apply_to_config(config, args) -> None:
    """Set the ``yarn_*`` attributes megatron-core's GPTModel and attention read on ``config``
    (a ``TransformerConfig``), as Megatron-LM does; nothing unless the positions are YaRN (the
    attention layers apply the factor whenever the attributes exist)."""
    if getattr(args, "position_embedding_type", None) != "yarn":
        return
    for dest, value in of_args(args).items():
        setattr(config, CONFIG_ATTR.get(dest, dest), value)


def describe(values: Mapping[str, object]) -> str:
    """The YaRN flags of ``values`` in one phrase, for log and error lines."""
    v = resolved(values)
    words = [f"{flag(d)} {v[d]}" for d in DEFAULTS if d != "yarn_correction_range_round_to_int"]
    if not v["yarn_correction_range_round_to_int"]:
        words.append("--no-yarn-correction-range-round-to-int")
    return " ".join(words)


# --- Hugging Face rope_scaling {"rope_type": "yarn", ...} -----------------------------------

HF_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
           "mscale", "mscale_all_dim", "truncate")
"""The yarn keys transformers reads (its ``_compute_yarn_parameters``)."""


def flags_from_hf(rope: Mapping[str, object], cfg: Mapping[str, object]) -> List[str]:
    """``pretrain_gpt.py`` flags of the YaRN that transformers builds from ``rope`` (the yarn
    dict of ``config.json``, its ``rope_scaling`` or ``rope_parameters``) and ``cfg`` (the whole
    config). Every value is written out, so the flags do not lean on either side's defaults.
    ValueError (one line) for what megatron-core's YaRN cannot express.

    transformers' rules, mapped: the original context is the config's top-level
    ``original_max_position_embeddings`` if any, else the dict's, else ``max_position_embeddings``;
    ``factor`` missing is ``max_position_embeddings / original``; ``beta_fast`` / ``beta_slow``
    missing (or 0) are 32 / 1; ``truncate`` is the correction-range rounding (default on). Its
    ``attention_factor``: given, it is used as is; else, with both ``mscale`` and ``mscale_all_dim``
    non-zero, ``m(s, mscale) / m(s, mscale_all_dim)``; else ``m(s, 1)``. megatron-core always
    divides by ``m(s, mscale_all_dim)``, so the last case is ``--mscale 1 --mscale-all-dim 0``
    (not the dict's lone ``mscale``), and a given ``attention_factor`` A is ``--mscale-all-dim 0
    --mscale (A - 1) / (0.1 ln s)``.
    """
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"yarn with partial_rotary_factor {partial} is not supported (megatron-core's YaRN "
                         "rotates every head dim)")
    original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ValueError(f"yarn original_max_position_embeddings must be a positive integer, got {original!r}")
    factor = rope.get("factor")
    if factor is None:
        factor = cfg.get("max_position_embeddings", original) / original
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"yarn factor must be a number > 0, got {factor!r}")
    factor = float(factor)
    betas = []
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        beta = rope.get(key) or default
        if not isinstance(beta, (int, float)) or beta <= 0:
            raise ValueError(f"yarn {key} must be a number > 0, got {rope.get(key)!r}")
        betas.append(float(beta))
    given, m, m_all = rope.get("attention_factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if given is not None:
        if not isinstance(given, (int, float)) or given <= 0:
            raise ValueError(f"yarn attention_factor must be a number > 0, got {given!r}")
        if factor <= 1:
            if given != 1:
                raise ValueError(f"yarn attention_factor {given} with factor {factor:g} <= 1: megatron-core's YaRN "
                                 "applies no attention factor without scaling")
            m, m_all = 1.0, 0.0
        else:
            m, m_all = (float(given) - 1.0) / (0.1 * math.log(factor)), 0.0
    elif not (m and m_all):
        m, m_all = 1.0, 0.0
    flags = ["--rotary-scaling-factor", repr(factor), "--yarn-original-max-position-embeddings", str(original),
             "--yarn-beta-fast", repr(betas[0]), "--yarn-beta-slow", repr(betas[1]),
             "--mscale", repr(float(m)), "--mscale-all-dim", repr(float(m_all))]
    if not rope.get("truncate", True):
        flags.append("--no-yarn-correction-range-round-to-int")
    return flags


def to_hf(values: Mapping[str, object]) -> Dict[str, object]:
    """The yarn entries of a transformers ``rope_scaling`` that build the YaRN of ``values``
    (a checkpoint's saved flags): the inverse of :func:`flags_from_hf`. The attention factor is
    transformers' default where it agrees (``--mscale 1 --mscale-all-dim 0``), ``mscale`` and
    ``mscale_all_dim`` where both are non-zero (the same formula on both sides), else
    ``attention_factor`` itself."""
    v = resolved(values)
    out: Dict[str, object] = {"rope_type": "yarn", "factor": float(v["rotary_scaling_factor"]),
                              "original_max_position_embeddings": int(v["yarn_original_max_position_embeddings"]),
                              "beta_fast": float(v["yarn_beta_fast"]), "beta_slow": float(v["yarn_beta_slow"])}
    m, m_all = float(v["mscale"]), float(v["mscale_all_dim"])
    if (m, m_all) != (1.0, 0.0):
        if m and m_all:
            out.update(mscale=m, mscale_all_dim=m_all)
        else:
            out["attention_factor"] = attention_factor(v)
    if not v["yarn_correction_range_round_to_int"]:
        out["truncate"] = False
    return out
