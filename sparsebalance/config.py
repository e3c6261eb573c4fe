"""Typed SparseBalance configuration: what the library needs to know about a run.

The driver builds one :class:`SparseBalanceConfig` from its flags
(``megatron.training.sb_config.sparsebalance_config``) and hands it down; nothing
under ``sparsebalance/`` reads command-line arguments. Each component validates
itself in ``__post_init__`` (ValueError with the field's name). Names of registered
implementations (kernel backend, packing strategy, DST policy) stay plain strings here:
the registry that resolves one checks it (``sparsebalance.ops``, ``batching.strategies``,
``tuning.policies``), so this module sits below everything it configures.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional, Sequence, Tuple


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def default_ladder(tau0: float, tails: Sequence[float] = (2.0, 1.5, 1.0, 0.7, 0.5, 0.3)) -> Tuple[float, ...]:
    """DST's default TAU levels around ``tau0``: the tail ``1 - tau0`` scaled by ``tails``
    (0.80, 0.85, 0.90, 0.93, 0.95, 0.97 at TAU0 0.9), rounded to 4 decimals and kept in (0, 1)."""
    out = sorted({round(1.0 - m * (1.0 - float(tau0)), 4) for m in tails} | {float(tau0)})
    return tuple(t for t in out if 0.0 < t < 1.0 or t == float(tau0))


def check_ladder(taus: Optional[Sequence[float]], tau0: float) -> Optional[str]:
    """Why ``taus`` cannot be DST's TAU levels around ``tau0`` (one line), or None if they can:
    at least two values, each in (0, 1], strictly increasing, ``tau0`` within their range."""
    if taus is None:
        return None
    t = [float(x) for x in taus]
    if len(t) < 2:
        return f"needs at least two TAU levels, got {t}"
    bad = [x for x in t if not (math.isfinite(x) and 0.0 < x <= 1.0)]
    if bad:
        return f"every TAU level must be in (0, 1], got {bad[0]:g}"
    if any(b <= a for a, b in zip(t, t[1:])):
        return f"TAU levels must be strictly increasing, got {','.join(f'{x:g}' for x in t)}"
    if not t[0] <= float(tau0) <= t[-1]:
        return f"the run's TAU {float(tau0):g} must lie within the levels [{t[0]:g}, {t[-1]:g}]"
    return None


@dataclass(frozen=True)
class AttentionConfig:
    """Block top-k sparse attention (flags ``--sparse-attention``, ``--sb-*``)."""

    sparse: bool = False
    """Sparse attention in every layer's ``core_attention`` slot (False: dense)."""
    block_size: int = 64
    """Routing block size, tokens."""
    topk: int = 8
    """Static budget k0: key blocks kept per query block besides sink and diagonal."""
    backend: str = "auto"
    """Kernel backend name (``sparsebalance.ops.BACKENDS`` key or "auto"; checked when resolved)."""
    dense_layers: Tuple[int, ...] = ()
    """1-based layer numbers that stay dense."""
    threshold: Optional[float] = None
    """Threshold routing's TAU (``--sb-routing threshold``; the budget is then the cap);
    None: top-k routing."""
    topk_min: int = 0
    """Threshold routing's least count of chosen blocks (``--sb-topk-min``)."""
    per_head: bool = True
    """Threshold routing's count per (query block, head); False: one per query block, the
    largest head's (``--sb-threshold-counts per-block``)."""

    def __post_init__(self) -> None:
        _check(isinstance(self.per_head, bool), f"attention.per_head must be a bool, got {self.per_head!r}")
        _check(self.threshold is None or (isinstance(self.threshold, (int, float)) and 0 < self.threshold <= 1),
               f"attention.threshold must be None or in (0, 1], got {self.threshold!r}")
        _check(isinstance(self.topk_min, int) and self.topk_min >= 0,
               f"attention.topk_min must be an int >= 0, got {self.topk_min!r}")
        _check(isinstance(self.block_size, int) and self.block_size >= 1,
               f"attention.block_size must be an int >= 1, got {self.block_size!r}")
        _check(isinstance(self.topk, int) and self.topk >= 0,
               f"attention.topk must be an int >= 0, got {self.topk!r}")

    @property
    def static_topk(self) -> Optional[int]:
        """The budget every op gets without DST (None: dense attention)."""
        return self.topk if self.sparse else None


@dataclass(frozen=True)
class PackingConfig:
    """Packing of documents into micro-batches (``--sb-batching``, ``--max-carry-steps``)."""

    strategy: str = "megatron"
    """``sparsebalance.batching.strategies.STRATEGIES`` key (checked when resolved)."""
    max_carry_steps: int = 2
    """Steps a document deferred by the packer may wait."""

    def __post_init__(self) -> None:
        _check(self.max_carry_steps >= 0, f"packing.max_carry_steps must be >= 0, got {self.max_carry_steps}")


@dataclass(frozen=True)
class DSTConfig:
    """Dynamic sparsity tuning (``--sb-dst``, ``--sb-anchor``, ``--sb-p``, ``--sb-topk-min|max``,
    ``--sb-attn-slack``, ``--no-sb-plan-ahead``, ``--sb-dst-sensitivity``, ``--sb-sensitivity-study``,
    ``--sb-stage-sensitivity``, ``--sb-dst-taus``, ``--sb-dst-tau-study``)."""

    policy: str = "off"
    """"off" or a ``sparsebalance.tuning.policies.DST_POLICIES`` key (checked when resolved)."""
    topk_min: int = 0
    """Smallest budget a plan may give."""
    topk_max: int = 0
    """Largest budget a plan may give."""
    anchor: str = "mean"
    """Anchor policy: aggregate (mean, max, min) of predicted latencies budgets aim at."""
    p: float = 0.1
    """Anchor policy: budgets stay within ``[(1-p) k0, (1+p) k0]``."""
    attn_slack: float = 0.0
    """Critical-path policy: retained attention may drop to ``(1 - slack)`` x static."""
    floor: str = "stage"
    """Critical-path policy: where that floor holds, on each stage ("stage": budget moves only
    between a stage's micro-batches) or over the whole step ("total")."""
    plan_ahead: bool = True
    """Plan step N+1 in a background thread while step N trains."""
    sensitivity: str = "off"
    """"off" or "estimate": among plans of the policy's step time and kept pairs, move budget
    to the micro-batches whose documents are estimated to lose most loss per dropped pair
    (``sparsebalance.tuning.sensitivity``)."""
    sensitivity_study: Optional[str] = None
    """Sensitivity study JSON (``documents`` with ``loss_delta``) the estimator starts from."""
    stage_weight: Optional[Tuple[float, ...]] = None
    """Weight per (virtual) stage: its layers' loss per dropped pair, relative (a stage profile,
    ``sparsebalance.tuning.stage_sensitivity``); among plans of the policy's step time and kept
    pairs, budget moves to the stages that weigh more. None: every stage alike."""
    taus: Optional[Tuple[float, ...]] = None
    """Threshold routing: DST's budget levels are these TAUs (the cap stays ``attention.topk``);
    None: :func:`default_ladder` around ``attention.threshold``."""
    tau_study: Optional[str] = None
    """Threshold routing: sparsity study JSON (documents measured at several TAUs) DST's TAU
    levels are priced by; None: the relation measured on SmolLM2-135M
    (``sparsebalance.batching.tau_curve.MEASURED``)."""

    def __post_init__(self) -> None:
        _check(0 <= self.topk_min <= self.topk_max,
               f"dst.topk_min {self.topk_min} / topk_max {self.topk_max}: need 0 <= min <= max")
        _check(self.anchor in ("mean", "max", "min"), f"dst.anchor must be mean, max or min, got {self.anchor!r}")
        _check(0.0 <= self.p < 1.0, f"dst.p must be in [0, 1), got {self.p}")
        _check(0.0 <= self.attn_slack <= 1.0, f"dst.attn_slack must be in [0, 1], got {self.attn_slack}")
        _check(self.floor in ("stage", "total"), f"dst.floor must be stage or total, got {self.floor!r}")
        _check(self.sensitivity in ("off", "estimate"),
               f"dst.sensitivity must be off or estimate, got {self.sensitivity!r}")
        _check(self.sensitivity == "off" or self.sensitivity_study is not None,
               "dst.sensitivity estimate needs a sensitivity study (dst.sensitivity_study)")
        if self.taus is not None:
            why = check_ladder(self.taus, min(self.taus, default=0.5))
            _check(why is None, f"dst.taus: {why}")
            object.__setattr__(self, "taus", tuple(float(x) for x in self.taus))
        if self.stage_weight is not None:
            w = tuple(self.stage_weight)
            _check(all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in w)
                   and any(x > 0 for x in w), "dst.stage_weight must be finite values >= 0, one positive")

    @property
    def enabled(self) -> bool:
        """A policy plans the budgets (policy is not "off")."""
        return self.policy != "off"


@dataclass(frozen=True)
class PredictorConfig:
    """The latency predictor (``--sb-profile``, ``--sb-cost-model``, ``--sb-allow-stale-profile``)
    and the run's settings a profile must have been made with."""

    profile: Optional[str] = None
    """Profile JSON of tools/profile_latency.py (None: none)."""
    cost_model: Optional[str] = None
    """Analytic cost model name instead of a profile (None: none)."""
    allow_stale_profile: bool = False
    """Accept a profile whose fingerprint does not match, with a warning."""
    seq_length: int = 4096
    """Micro-batch capacity, tokens (profile fingerprint)."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm (profile fingerprint)."""
    bf16: bool = False
    """bf16 parameters (profile fingerprint; else fp32)."""

    def __post_init__(self) -> None:
        _check(self.profile is None or self.cost_model is None,
               "predictor: give a profile or a cost model, not both")
        _check(self.seq_length >= 1, f"predictor.seq_length must be >= 1, got {self.seq_length}")

    @property
    def enabled(self) -> bool:
        """A predictor is configured."""
        return self.profile is not None or self.cost_model is not None


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape and routing parameters that latency depends on: the trained model
    as the predictor sees it. Field names follow megatron's argument names
    (``--hidden-size`` -> ``hidden_size``); the defaults describe a Qwen2.5-0.5B-like
    layer stack with the paper's MoBA routing (block 256, top-k 32)."""

    num_layers: int = 24
    """Transformer layers of the whole model (split evenly over PP stages, apart from
    ``first_stage_layers`` / ``last_stage_layers``)."""
    hidden_size: int = 896
    """Model width h."""
    num_attention_heads: int = 14
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA groups); equal to num_attention_heads for MHA."""
    kv_channels: Optional[int] = None
    """Head dimension; None = hidden_size // num_attention_heads."""
    ffn_hidden_size: int = 4864
    """MLP inner width."""
    vocab_size: int = 151936
    """(Padded) vocabulary size of the output layer."""
    swiglu: bool = True
    """Gated MLP (three weight matrices) instead of two."""
    block_size: int = 256
    """Routing block size of the sparse attention, tokens."""
    topk: Optional[int] = 32
    """Default budget (key blocks kept besides sink + diagonal); None = dense."""
    first_stage_layers: Optional[int] = None
    """Layers of the first pipeline stage when PP > 1 (Megatron-LM's
    ``--decoder-first-pipeline-num-layers``); None: its share of the even split."""
    last_stage_layers: Optional[int] = None
    """Layers of the last pipeline stage when PP > 1 (``--decoder-last-pipeline-num-layers``)."""
    stage_layers: Optional[Tuple[int, ...]] = None
    """Layers of each pipeline stage, first to last (the driver's placement for Megatron-LM's
    pipeline-split flags, e.g. ``--pipeline-model-parallel-layout``); overrides
    ``first_stage_layers`` / ``last_stage_layers``. None: those, or the even split."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads "
                             "when kv_channels is not given")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        if self.topk is not None and self.topk < 0:
            raise ValueError(f"topk must be >= 0 or None, got {self.topk}")
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= self.num_layers:
                raise ValueError(f"{name} must be in [0, num_layers], got {getattr(self, name)}")
        if self.stage_layers is not None:
            counts = tuple(self.stage_layers)
            if not counts or any(int(n) != n or n < 0 for n in counts) or sum(counts) != self.num_layers:
                raise ValueError(f"stage_layers must be counts >= 0 adding up to num_layers ({self.num_layers}), "
                                 f"got {list(counts)}")
            object.__setattr__(self, "stage_layers", tuple(int(n) for n in counts))

    @property
    def head_dim(self) -> int:
        """Head dimension in channels."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    # Per-token FLOPs of one layer's matmuls (forward, 2 FLOPs per multiply-add).
    @property
    def attn_linear_flops(self) -> float:
        """QKV + output projection FLOPs per token."""
        q = self.num_attention_heads * self.head_dim
        kv = 2 * self.num_query_groups * self.head_dim
        return 2.0 * self.hidden_size * (q + kv) + 2.0 * q * self.hidden_size

    @property
    def mlp_flops(self) -> float:
        """MLP FLOPs per token."""
        return 2.0 * self.hidden_size * self.ffn_hidden_size * (3 if self.swiglu else 2)

    @property
    def attn_pair_flops(self) -> float:
        """Core-attention FLOPs per kept (query, key) pair of one head, summed over heads
        (QK^T and PV: 2 matmuls x 2 FLOPs x head_dim x heads)."""
        return 4.0 * self.head_dim * self.num_attention_heads

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ModelShape":
        """Build from keyword arguments; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown model_cfg keys {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def layers_of(self, stage: int, pp: int) -> int:
        """Transformer layers held by pipeline stage ``stage`` of ``pp``: ``first_stage_layers``
        / ``last_stage_layers`` where given (PP > 1), the rest split evenly over the other
        stages, as megatron-core's ``num_layers_in_first/last_pipeline_stage`` place them."""
        if pp < 1:
            raise ValueError(f"pp must be >= 1, got {pp}")
        if not 0 <= stage < pp:
            raise ValueError(f"stage must be in [0, {pp}), got {stage}")
        if self.stage_layers is not None:
            if len(self.stage_layers) != pp:
                raise ValueError(f"stage_layers holds {len(self.stage_layers)} stages, asked for {pp}")
            return self.stage_layers[stage]
        ends = {0: self.first_stage_layers, pp - 1: self.last_stage_layers} if pp > 1 else {}
        if ends.get(stage) is not None:
            return int(ends[stage])
        given = [n for n in ends.values() if n is not None]
        rest, stages = self.num_layers - sum(given), pp - len(given)
        if not given and rest % pp:
            raise ValueError(f"num_layers ({self.num_layers}) is not divisible by pp ({pp})")
        if rest < 0 or rest % stages:
            raise ValueError(f"num_layers ({self.num_layers}) less the first/last stage's ({given}) is not "
                             f"divisible by the other {stages} stage(s)")
        return rest // stages


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout (``--pipeline-model-parallel-size`` etc.)."""

    pp: int = 1
    """Pipeline ranks."""
    vpp: int = 1
    """Model chunks per pipeline rank (> 1: the interleaved schedule)."""
    cp: int = 1
    """Context-parallel ranks per micro-batch."""
    sp: int = 1
    """Sequence-parallel ranks a micro-batch's tokens are split over: the tensor-parallel
    size under ``--sequence-parallel``, else 1. Each micro-batch is padded so that every
    CP rank's share is a multiple of it (:func:`sparsebalance.cp_split.sequence_parallel_pad`)."""
    cpu: bool = False
    """The run trains on CPU."""
    group: Optional[int] = None
    """Interleaved schedule: micro-batches each virtual stage runs before the next (megatron-core's
    ``microbatch_group_size_per_vp_stage``); None: ``pp``."""

    def __post_init__(self) -> None:
        for name in ("pp", "vpp", "cp", "sp"):
            _check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.group is None or self.group >= 1, f"parallel.group must be None or >= 1, got {self.group}")

    @property
    def stages(self) -> int:
        """Virtual pipeline stages, ``pp * vpp``."""
        return self.pp * self.vpp

    @property
    def schedule(self) -> str:
        """megatron-core's schedule: "interleaved" when vpp > 1, else "1f1b"."""
        return "interleaved" if self.vpp > 1 else "1f1b"


@dataclass(frozen=True)
class SparseBalanceConfig:
    """Everything the library needs about one run; built once by the driver."""

    model: ModelShape
    """Model shape (its routing fields: the attention's block size and static budget)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """Sparse attention."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Packing strategy (SAB or a baseline)."""
    dst: DSTConfig = field(default_factory=DSTConfig)
    """Dynamic sparsity tuning."""
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    """Latency predictor."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""

    def __post_init__(self) -> None:
        _check(not self.dst.enabled or self.attention.sparse,
               f"dst.policy {self.dst.policy} tunes sparse-attention budgets: attention.sparse must be on")
        _check(not self.dst.enabled or self.dst.topk_min <= self.attention.topk <= self.dst.topk_max,
               f"need dst.topk_min {self.dst.topk_min} <= attention.topk {self.attention.topk} "
               f"<= dst.topk_max {self.dst.topk_max}")
        _check(self.dst.stage_weight is None or len(self.dst.stage_weight) == self.parallel.stages,
               f"dst.stage_weight needs one weight per stage ({self.parallel.stages})")
        _check(self.attention.threshold is not None or (self.dst.taus is None and self.dst.tau_study is None),
               "dst.taus / dst.tau_study are threshold routing's levels: attention.threshold must be set")
        if self.dst.taus is not None:
            why = check_ladder(self.dst.taus, self.attention.threshold)
            _check(why is None, f"dst.taus: {why}")

    @property
    def dst_taus(self) -> Optional[Tuple[float, ...]]:
        """DST's TAU levels under threshold routing (``dst.taus`` or the default ladder around
        ``attention.threshold``, which is always a level); None under top-k routing or without DST."""
        if not self.dst.enabled or self.attention.threshold is None:
            return None
        tau0 = float(self.attention.threshold)
        taus = self.dst.taus if self.dst.taus is not None else default_ladder(tau0)
        return tuple(sorted(set(taus) | {tau0}))
