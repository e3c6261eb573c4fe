"""The SparseBalance coordinator: each step's packing and DST plan, and online recalibration.

The driver enters the library twice a step (the attention modules are the third way in):

1. :meth:`StepPlanner.next_step` -> :class:`PlannedStep`: the sampler's packing of the
   step (SAB or a baseline, :mod:`sparsebalance.batching.sampler`), its document lengths
   ``[dp][microbatch][segment]`` as trained, the density the static budget would keep
   and, with a :class:`Balancer`, the step's :class:`StepForecast`. Under DST that is
   :func:`sparsebalance.tuning.from_predictor.build_instance` and the configured policy
   (:data:`sparsebalance.tuning.policies.DST_POLICIES`) -> ``budget[dp][microbatch][virtual
   stage]``, the budget's one form, checked once here (:func:`check_budget`); the
   driver's data iterators put each micro-batch's entry on it and it rides on the
   micro-batch's packed params to the kernel. Under threshold routing DST's levels are
   TAUs (:func:`sparsebalance.tuning.from_predictor.build_tau_instance`, each priced by SAB's
   density estimator at that TAU, :attr:`PlannedStep.tau_densities`) and the table is
   ``StepForecast.tau`` (:func:`check_tau`); the cap stays the static top-k. Without DST: the
   op times at the static budget and the pipeline model's step time.
2. :meth:`Balancer.observe`: after the step, the gathered measured per-(micro-batch,
   stage) forward/backward times are folded into the predictor's per-(stage, phase)
   correction (one observation per (stage, phase) per step: the ratio of the step's
   measured sum to the uncalibrated model's sum), so the next step's plan adapts.

Every rank runs the same deterministic code on the same inputs (no communication beyond
the per-step gather the driver does anyway), so all ranks plan the same budgets.

Planning ahead (the default under DST): :class:`StepPlanner` packs step N+1 when it hands
out step N and the balancer plans it in a background thread while step N trains, so
planning is off the step's critical path; measured on the 2-core CPU machine, planning
in line cost ~2% of every step, about as much as DST gains. The plan of step N+1 then
uses the correction as of the end of step N-1 (one step older), which is the same on
every rank: the thread starts after one observation and :meth:`Balancer.observe` waits
for it before the next, so budgets stay rank-identical. The planner's
:meth:`StepPlanner.state_dict` is the sampler's state before the step packed ahead, so
a checkpoint resumes at the step not yet trained.

Checkpoints (:meth:`Balancer.state_dict`) hold the correction and, for planning
ahead, the correction as it was before the last step's observation: the plan of the
first step after a resume is built from that one, exactly as the uninterrupted run's
background plan was, so budgets (and losses) continue bit for bit. A checkpoint
without this state (written before it was saved) or saved with another number of
(virtual) pipeline stages starts from the uncalibrated model, with one warning.

Data order does not depend on measured times: SAB packs with its own predictor
instance whose correction stays 1.0 (the plan is a function of (seed, step) only, as
Megatron users expect and resumption needs); run-time budgets do adapt. Under threshold
routing SAB also predicts each document's density, learnt from the attention records
(:mod:`sparsebalance.batching.density_feedback`): the packing of step ``t`` then depends on
(seed, records of steps before ``t - 1``), the same on every rank and after a resume
(:meth:`StepPlanner.state_dict` saves the estimator as it is at the save).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Hashable, List, Optional, Tuple

import numpy as np

from sparsebalance.config import AttentionConfig, ModelShape, ParallelConfig, SparseBalanceConfig
from sparsebalance.pairs import density, kept_pairs

Lengths = List[List[List[int]]]
"""Segment token counts ``[dp][microbatch][segment]`` of one step."""


def attention_backend_choice(attention: AttentionConfig, parallel: ParallelConfig, head_dim: int,
                             bf16: bool) -> dict:
    """The kernel backend a run resolves to and why: ``{"backend", "reason", ...}``
    (:func:`sparsebalance.ops.autoselect.backend_choice`: on CUDA, ``auto`` is the fastest
    backend that passed verification on this device, measured once and cached; on CPU the
    rule cpu > reference). Dense attention is ``sdpa`` (tools/profile_latency.py's name)."""
    import torch

    if not attention.sparse:
        from sparsebalance.attention.dense import dense_backend_for

        cuda = torch.cuda.is_available() and not parallel.cpu
        kernel = dense_backend_for(torch.device("cuda" if cuda else "cpu"),
                                   torch.bfloat16 if bf16 else torch.float32)
        said = "FlashAttention-4 varlen, one call per layer" if kernel == "fa4" else "SDPA per document"
        return {"backend": "sdpa", "reason": f"dense attention ({said})", "dense_kernel": kernel,
                "timings_ms": {}, "failed": {}, "key": None, "source": "flag"}

    from sparsebalance.ops.autoselect import backend_choice

    cuda = torch.cuda.is_available() and not parallel.cpu
    return backend_choice(attention.backend, torch.device("cuda" if cuda else "cpu"), head_dim,
                          attention.block_size, torch.bfloat16 if bf16 else torch.float32)


def attention_backend(attention: AttentionConfig, parallel: ParallelConfig, model: ModelShape,
                      bf16: bool) -> str:
    """The kernel backend name a run of ``model`` (``bf16``: in bf16) resolves to (what
    profiles record)."""
    return attention_backend_choice(attention, parallel, model.hidden_size // model.num_attention_heads,
                                    bf16)["backend"]


def build_predictor(config: SparseBalanceConfig, warn=None):
    """The latency predictor of ``config.predictor`` (None if it names none).

    Args:
        warn: called with each warning line (a stale profile under
            ``allow_stale_profile``); None drops them.

    Raises:
        FileNotFoundError: missing profile (the message holds the command that makes it).
        ValueError: stale or malformed profile, unknown model.
    """
    import warnings

    from sparsebalance.predictor import get_predictor

    m, att, pc = config.model, config.attention, config.predictor
    shape = dict(num_layers=m.num_layers, hidden_size=m.hidden_size,
                 num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                 ffn_hidden_size=m.ffn_hidden_size, vocab_size=m.vocab_size, swiglu=m.swiglu,
                 block_size=att.block_size, topk=att.static_topk,
                 # each stage's own layers (Megatron-LM's pipeline-split flags), not the even split
                 first_stage_layers=m.first_stage_layers, last_stage_layers=m.last_stage_layers,
                 stage_layers=m.stage_layers)
    # Under context parallelism the predictor answers per-rank times of a CP group,
    # K/V exchange included (sparsebalance.predictor.context_parallel); under sequence
    # parallelism it prices each micro-batch's padding.
    cp = {"context_parallel_size": config.parallel.cp, "sequence_parallel_size": config.parallel.sp}
    if pc.cost_model is not None:
        return get_predictor(pc.cost_model, **shape, **cp)
    if pc.profile is None:
        return None
    # Every model-fingerprint entry the profiler records, so a mismatch is caught and
    # the "create it" command of a missing profile reproduces this run's setup.
    expect = {"attention": "sparse" if att.sparse else "dense",
              "attention_backend": attention_backend(att, config.parallel, m, pc.bf16),
              "seq_length": pc.seq_length, "normalization": pc.normalization,
              "params_dtype": "bf16" if pc.bf16 else "fp32"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pred = get_predictor(pc.profile, allow_stale=pc.allow_stale_profile,
                             expect=expect, **shape, **cp)
    for w in caught:
        if warn is not None:
            warn(" ".join(str(w.message).split()))
    return pred


def stage_tables(predictor, lengths: Lengths, topk: Optional[int], stages: int):
    """Calibrated forward/backward ms ``[dp, M, stages]`` of every micro-batch at one
    budget (None: dense): :func:`~sparsebalance.tuning.from_predictor.op_ms_tables` at
    that single level, the numbers ``build_instance`` gives for it."""
    from sparsebalance.tuning.from_predictor import op_ms_tables

    fwd, bwd = op_ms_tables(predictor, lengths, [topk], stages)
    return fwd[0], bwd[0]


@dataclass
class StepForecast:
    """What the planner decided and predicted for one step."""

    budget: Optional[np.ndarray]
    """[dp, M, S] DST budgets (None: DST off)."""
    fwd_ms: np.ndarray
    """[dp, M, S] predicted forward ms of each op at its budget (calibrated)."""
    bwd_ms: np.ndarray
    """[dp, M, S] predicted backward ms."""
    step_ms: float
    """Pipeline-model step time of the prediction, ms."""
    baseline_step_ms: float
    """Same with every op at the static budget (== step_ms without DST), ms."""
    plan_ms: float
    """Wall time of building the instance + planning, ms."""
    model: Tuple[np.ndarray, np.ndarray]
    """Uncalibrated (fwd, bwd) ``[dp, M, S]`` ms the step's observation is compared with."""
    wait_ms: float = 0.0
    """Time the step waited for its plan, ms (== plan_ms when planned in line)."""
    tau: Optional[np.ndarray] = None
    """[dp, M, S] DST's TAU per op under threshold routing (``budget`` is then None: every op
    keeps the static cap); None: DST off or top-k routing."""


class Balancer:
    """Per-step DST planning and online recalibration on one rank (see module docstring).

    Args:
        config: the run's configuration (reads ``dst``, ``attention`` and ``parallel``).
        predictor: LatencyPredictor whose correction this object updates.
    """

    def __init__(self, config: SparseBalanceConfig, predictor) -> None:
        self.config = config
        self.ahead = config.dst.enabled and config.dst.plan_ahead
        self.predictor = predictor
        self.pp, self.vpp = config.parallel.pp, config.parallel.vpp
        self.stages = config.parallel.stages
        self.schedule, self.group = config.parallel.schedule, config.parallel.group
        self.topk = config.attention.static_topk
        self.taus = config.dst_taus
        """DST's TAU levels (threshold routing), None: DST plans top-k."""
        self._policy = None
        if config.dst.enabled:  # the registry checks the name (ValueError listing the policies)
            from sparsebalance.tuning.policies import DST_POLICIES

            self._policy = DST_POLICIES.pick(config.dst.policy)
        self._pending: Optional[tuple] = None  # (step, thread, result box) planned ahead
        # Recalibrator state before the last observe(): what a plan made ahead during the
        # last step read (saved so a resumed run plans its first step from it).
        self._before_last: dict = predictor.recalibrator.state_dict()
        self._resume_from: Optional[dict] = None  # set by load_state_dict, used once

    def plan(self, lengths: Lengths, weight: Optional[np.ndarray] = None,
             densities: Optional[dict] = None) -> StepForecast:
        """Plan the budgets of a step of document ``lengths`` (under DST) and predict it.
        ``weight``: [dp, M] sensitivity weights (:class:`SensitivityWeights`; used under
        ``dst.sensitivity`` "estimate", see :mod:`sparsebalance.tuning.sensitivity`); under
        ``dst.stage_weight`` each op's weight is its stage's (times its micro-batch's).
        ``densities``: under threshold routing, TAU level -> per-document densities nested like
        ``lengths`` (:func:`level_densities`), what DST's TAU levels are priced by."""
        from sparsebalance.pipeline import simulate

        t0 = time.perf_counter()
        dst, pred = self.config.dst, self.predictor
        budget = tau = None
        if dst.enabled and self._nothing_to_trade(lengths):
            # Static top-k already keeps every pair of every document: no raise adds attention,
            # and at attention slack 0 no cut may lose any, so the plan is the static one.
            budget = np.full((len(lengths), len(lengths[0]), self.stages), self.topk, dtype=np.int64)
            fwd, bwd = stage_tables(pred, lengths, self.topk, self.stages)
            step_ms = base_ms = simulate(fwd, bwd, schedule=self.schedule, vpp=self.vpp, group=self.group).step_ms
        elif dst.enabled:
            weight = weight if dst.sensitivity != "off" else None
            if dst.stage_weight is not None:  # per op: the stage's weight (x the micro-batch's)
                from sparsebalance.tuning.stage_sensitivity import op_weights

                weight = op_weights(dst.stage_weight, len(lengths), len(lengths[0]), weight)
            inst = self.instance(lengths, weight, densities)
            plan = self._policy(inst, dst)
            if inst.weight is not None:  # same step time and kept pairs, budget where it counts
                from sparsebalance.tuning.sensitivity import sensitivity_plan

                plan = sensitivity_plan(inst, plan)
            if inst.unit == "tau":
                tau = check_tau(plan.budget, lengths, self.stages)
                fwd, bwd, _ = inst.at(inst.indices(tau))
            else:
                budget = check_budget(plan.budget, lengths, self.stages)
                fwd, bwd, _ = inst.at(inst.indices(budget))
            step_ms, base_ms = plan.step_ms, plan.baseline_step_ms
        else:
            fwd, bwd = stage_tables(pred, lengths, self.topk, self.stages)
            step_ms = base_ms = simulate(fwd, bwd, schedule=self.schedule, vpp=self.vpp, group=self.group).step_ms
        corr = np.array([[pred.correction(s, ph) for s in range(self.stages)]
                         for ph in ("fwd", "bwd")])
        ms = (time.perf_counter() - t0) * 1e3
        return StepForecast(budget=budget, fwd_ms=np.asarray(fwd), bwd_ms=np.asarray(bwd),
                            step_ms=float(step_ms), baseline_step_ms=float(base_ms), plan_ms=ms,
                            model=(np.asarray(fwd) / corr[0], np.asarray(bwd) / corr[1]),
                            wait_ms=ms, tau=tau)

    def _nothing_to_trade(self, lengths: Lengths) -> bool:
        """Whether critical-path DST at attention slack 0 under top-k routing has nothing to
        plan for this step: static top-k keeps every (query, key) pair of every document (each
        is at most ``topk + 2`` blocks long), so its plan is the static one, made without the
        planner (on a CPU whose cores the ranks use, the planner's thread would slow the step)."""
        dst = self.config.dst
        if dst.policy != "critical-path" or dst.attn_slack != 0 or self.taus is not None or self.topk is None:
            return False
        docs = [np.asarray(mb, dtype=np.int64).ravel() for r in lengths for mb in r]
        if not docs or any(d.size == 0 for d in docs):
            return False  # the planner names what is wrong with the step
        flat = np.concatenate(docs)
        B = self.config.attention.block_size
        return bool(np.array_equal(kept_pairs(flat, self.topk, B), kept_pairs(flat, None, B)))

    def instance(self, lengths: Lengths, weight: Optional[np.ndarray] = None, densities: Optional[dict] = None):
        """The planning :class:`~sparsebalance.tuning.instance.Instance` of a step of document
        ``lengths`` that :meth:`plan` hands DST's policy (``weight``: [dp, M] sensitivity
        weights, None: none; ``densities``: as in :meth:`plan`, needed under threshold routing):
        for a harness that refines or compares plans on it."""
        from sparsebalance.tuning.from_predictor import build_instance, build_tau_instance

        dst, att = self.config.dst, self.config.attention
        if self.taus is not None:
            if densities is None or set(map(float, densities)) != set(self.taus):
                raise ValueError(f"DST under threshold routing prices its TAU levels {list(self.taus)} by the "
                                 "step's per-document densities at each: the step has none for them")
            return build_tau_instance(self.predictor, lengths, pp=self.pp, vpp=self.vpp, schedule=self.schedule,
                                      group=self.group, cap=att.topk, tau0=att.threshold, densities=densities,
                                      weight=weight, topk_min=att.topk_min)
        return build_instance(self.predictor, lengths, pp=self.pp, vpp=self.vpp, schedule=self.schedule,
                              group=self.group,
                              k0=self.config.attention.topk, kmin=dst.topk_min, kmax=dst.topk_max, weight=weight)

    def forecast(self, step: Hashable, lengths: Lengths, then: Optional[tuple] = None,
                 weight: Optional[np.ndarray] = None, densities: Optional[dict] = None) -> StepForecast:
        """The plan of ``step`` (any object naming the step, compared by identity) of
        document ``lengths``: the one planned ahead for it (waiting for it if it is not
        done), else planned now. ``then``: the next ``(step, lengths[, weight[, densities]])``,
        whose plan :meth:`plan_ahead` starts once this one is in hand (None: no next
        step). ``weight``, ``densities``: as in :meth:`plan`."""
        out = self._forecast(step, lengths, weight, densities)
        if then is not None:
            self.plan_ahead(*then)
        return out

    def _forecast(self, step: Hashable, lengths: Lengths, weight=None, densities=None) -> StepForecast:
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not step:
            self._join(pending)
            if self._resume_from is not None:  # first step after a resume (see docstring)
                return self._plan_with(self._resume_from, lengths, weight, densities)
            return self.plan(lengths, weight, densities)
        t0 = time.perf_counter()
        out = self._join(pending)
        out.wait_ms = (time.perf_counter() - t0) * 1e3
        return out

    def plan_ahead(self, step: Hashable, lengths: Lengths, weight: Optional[np.ndarray] = None,
                   densities: Optional[dict] = None) -> None:
        """Start planning the next ``step`` of document ``lengths`` in the background
        (no-op unless planning ahead); :meth:`forecast` collects it."""
        if not self.ahead:
            return
        self._join(self._pending)
        box: dict = {}

        def work() -> None:
            try:
                box["out"] = self.plan(lengths, weight, densities)
            except BaseException as e:  # re-raised on the training thread by _join
                box["err"] = e

        thread = threading.Thread(target=work, name="sb-plan-ahead", daemon=True)
        thread.start()
        self._pending = (step, thread, box)

    @staticmethod
    def _join(pending) -> Optional[StepForecast]:
        if pending is None:
            return None
        pending[1].join()
        if "err" in pending[2]:
            raise pending[2]["err"]
        return pending[2]["out"]

    def observe(self, forecast: StepForecast, measured_fwd_ms: np.ndarray,
                measured_bwd_ms: np.ndarray) -> None:
        """Fold the step's measured ``[dp, M, S]`` op times into the predictor's
        per-(stage, phase) correction (identical on every rank: same inputs). A plan
        being made ahead reads the correction, so it is finished first."""
        self._join(self._pending)  # keeps it pending: forecast() collects the result
        self._resume_from = None
        self._before_last = self.predictor.recalibrator.state_dict()
        for phase, model, meas in (("fwd", forecast.model[0], measured_fwd_ms),
                                   ("bwd", forecast.model[1], measured_bwd_ms)):
            for s in range(self.stages):
                m, t = float(model[:, :, s].sum()), float(np.asarray(meas)[:, :, s].sum())
                if m > 0 and t > 0:
                    self.predictor.observe(s, phase, m, t)

    def _plan_with(self, recal_state: dict, lengths: Lengths, weight=None, densities=None) -> StepForecast:
        """:meth:`plan` under another recalibrator state, then back to the current one
        (nothing else reads the predictor meanwhile: no plan is pending)."""
        current = self.predictor.recalibrator.state_dict()
        self.predictor.recalibrator.load_state_dict(recal_state)
        try:
            return self.plan(lengths, weight, densities)
        finally:
            self.predictor.recalibrator.load_state_dict(current)

    def state_dict(self) -> dict:
        """What a resumed run needs to plan the same budgets (identical on every rank):
        the predictor's correction now and before the last step's observation."""
        self._join(self._pending)  # the background plan reads the predictor: let it finish
        return {"stages": self.stages, "predictor": self.predictor.state_dict(),
                "before_last": self._before_last}

    def load_state_dict(self, state: Optional[dict], warn=None) -> None:
        """Restore :meth:`state_dict`'s output. ``state`` None (a checkpoint written before
        this state was saved) or saved with another number of virtual stages: keep the
        uncalibrated predictor and tell ``warn`` (one line). ValueError if malformed."""
        from sparsebalance.predictor.recalibration import Recalibrator

        why = None
        if state is None:
            why = "the checkpoint has no SparseBalance predictor state (saved by an older version)"
        elif state.get("stages") != self.stages:
            why = (f"the checkpoint's predictor state is for {state.get('stages')} pipeline "
                   f"stages, this run has {self.stages}")
        if why is not None:
            if warn is not None:
                warn(f"{why}; DST budgets restart from the uncalibrated predictor")
            return
        try:
            self.predictor.load_state_dict(state["predictor"])
            before = dict(state["before_last"])
            recal = self.predictor.recalibrator
            Recalibrator(alpha=recal.alpha, clip=recal.clip).load_state_dict(before)  # validates
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--load: SparseBalance predictor state is malformed: {e}") from None
        self._before_last = before
        self._resume_from = before if self.ahead else None



def check_budget(budget, lengths: Lengths, stages: int) -> np.ndarray:
    """A DST policy's table as ``int64 [dp, M, stages]``, checked against the step it plans
    (the budget's one check between planner and kernel).

    Raises:
        ValueError: wrong shape for ``lengths`` and ``stages``, or a negative budget.
    """
    b = np.asarray(budget, dtype=np.int64)
    want = (len(lengths), len(lengths[0]) if lengths else 0, stages)
    if b.shape != want:
        raise ValueError(f"budget table is {b.shape}, the step needs [dp, microbatch, stage] = {want}")
    if (b < 0).any():
        raise ValueError(f"budgets must be >= 0, got {int(b.min())}")
    return b


def check_tau(tau, lengths: Lengths, stages: int) -> np.ndarray:
    """A DST policy's TAU table (threshold routing) as ``float64 [dp, M, stages]``, checked
    against the step it plans.

    Raises:
        ValueError: wrong shape for ``lengths`` and ``stages``, or a TAU outside (0, 1].
    """
    t = np.asarray(tau, dtype=np.float64)
    want = (len(lengths), len(lengths[0]) if lengths else 0, stages)
    if t.shape != want:
        raise ValueError(f"TAU table is {t.shape}, the step needs [dp, microbatch, stage] = {want}")
    if not np.all((t > 0) & (t <= 1)):
        raise ValueError(f"TAUs must be in (0, 1], got {float(t[~((t > 0) & (t <= 1))][0])}")
    return t


def level_densities(estimator, packing, lengths: Lengths, taus) -> dict:
    """TAU -> per-segment densities ``[dp][microbatch][segment]`` of a step at each of DST's TAU
    levels: ``estimator``'s (:class:`~sparsebalance.batching.density_feedback.ThresholdDensity`)
    predictions for the documents of ``packing`` (``StepPacking``), nested like ``lengths``; a
    trailing padding segment is predicted from its length alone."""
    segs = [s for rank in packing.ranks for mb in rank for s in mb]
    ids = np.array([s[0] for s in segs], dtype=np.int64)
    seg_len = np.array([s[2] for s in segs], dtype=np.int64)
    extra = [(r, m, n) for r, rank in enumerate(lengths) for m, mb in enumerate(rank)
             for n in mb[len(packing.ranks[r][m]):]]
    out = {}
    for t in taus:
        flat = iter(estimator.densities(seg_len, ids, t).tolist())
        pad = iter(estimator.densities([n for _, _, n in extra], None, t).tolist() if extra else [])
        out[float(t)] = [[[next(flat) for _ in packing.ranks[r][m]] + [next(pad) for _ in mb[len(packing.ranks[r][m]):]]
                          for m, mb in enumerate(rank)] for r, rank in enumerate(lengths)]
    return out


@dataclass
class PlannedStep:
    """One training step as the library decided it (:meth:`StepPlanner.next_step`)."""

    packing: "object"
    """The sampler's :class:`~sparsebalance.batching.packing.StepPacking` (every DP rank's
    segments)."""
    lengths: Lengths
    """Attention segment lengths ``[dp][microbatch][segment]`` as trained (padding segment
    included): what the balancer plans and predicts."""
    static_density: Optional[float] = None
    """Fraction of causal pairs the static top-k keeps on this step's documents (the
    baseline DST's retained attention is compared with); None: dense attention."""
    forecast: Optional[StepForecast] = None
    """The balancer's plan and prediction (None: no balancer); under DST its ``budget`` is
    the step's ``[dp][microbatch][virtual stage]`` top-k table (threshold routing: its ``tau``
    the TAU table)."""
    tau_densities: Optional[dict] = None
    """Under threshold routing with DST: TAU level -> per-segment predicted densities
    ``[dp][microbatch][segment]`` (:func:`level_densities`, made when the step is packed)."""


class StepPlanner:
    """Each step's decisions in one call: the sampler's packing and, with a balancer, its
    plan, looked ahead one step when the balancer plans ahead (see module docstring).

    Args:
        sampler: :class:`~sparsebalance.batching.sampler.PackingSampler` of the split.
        balancer: :class:`Balancer` (None: packing only, no forecast).
        pad_to: every micro-batch is padded to this many tokens by one trailing segment
            (None: no padding); it enters the lengths as trained.
        attention: the run's :class:`~sparsebalance.config.AttentionConfig`; sparse: each
            step's ``static_density`` (None: not computed).
        sensitivity: :class:`SensitivityWeights` of the run's documents (None: none); each
            step's weights go to the balancer with its lengths.
    """

    def __init__(self, sampler, balancer: Optional[Balancer] = None, pad_to: Optional[int] = None,
                 attention: Optional[AttentionConfig] = None,
                 sensitivity: Optional["SensitivityWeights"] = None) -> None:
        self.sampler, self.balancer, self.pad_to = sampler, balancer, pad_to
        self.sensitivity = sensitivity
        self.attention = attention if attention is not None and attention.sparse else None
        self._ahead: Optional[Tuple[dict, PlannedStep]] = None  # (sampler state before it, step)

    def _pack(self) -> PlannedStep:
        packing = self.sampler.next_step()
        step = PlannedStep(packing=packing, lengths=packing.lengths(self.pad_to))
        taus = getattr(self.balancer, "taus", None)
        if taus is not None:  # priced now, with the estimator as it is at packing (the same on every rank)
            estimator = getattr(self.sampler, "density", None)
            if estimator is None:
                raise ValueError("DST under threshold routing needs the sampler's density estimator "
                                 "(ThresholdDensity) to price its TAU levels")
            step.tau_densities = level_densities(estimator, packing, step.lengths, taus)
        if self.attention is not None:
            step.static_density = density([n for rank in step.lengths for mb in rank for n in mb],
                                          self.attention.topk, self.attention.block_size)
        return step

    def next_step(self, more: bool = True) -> PlannedStep:
        """The next step (identical on every rank). ``more``: another step follows, so
        it may be packed and planned ahead now."""
        if self._ahead is not None:
            step, self._ahead = self._ahead[1], None
        else:
            step = self._pack()
        if self.balancer is not None:
            then = None
            if more and self.balancer.ahead:
                state = self.sampler.state_dict()
                nxt = self._pack()
                self._ahead = (state, nxt)
                then = (nxt, nxt.lengths, None if self.sensitivity is None else self._weight(nxt),
                        nxt.tau_densities)
            more_kw = {} if self.sensitivity is None else {"weight": self._weight(step)}
            if step.tau_densities is not None:
                more_kw["densities"] = step.tau_densities
            step.forecast = self.balancer.forecast(step, step.lengths, then=then, **more_kw)
        return step

    def _weight(self, step: PlannedStep) -> np.ndarray:
        return self.sensitivity(step.packing, step.lengths)

    def state_dict(self) -> dict:
        """The sampler's state at the first step not handed out (a step packed ahead is
        packed again after a resume), with the density estimator's state as it is now: it
        holds observations made after the step packed ahead was packed, and defers their
        use by its lag, so the repacked step sees what it saw the first time."""
        if self._ahead is None:
            return self.sampler.state_dict()
        state = dict(self._ahead[0])
        live = self.sampler.state_dict()
        if "density" in live:
            state["density"] = live["density"]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at :meth:`state_dict`'s step (a step packed ahead is dropped)."""
        self._ahead = None
        self.sampler.load_state_dict(state)


class SensitivityWeights:
    """Each micro-batch's sensitivity weight (nats per dropped pair,
    :func:`sparsebalance.tuning.sensitivity.microbatch_weights`) from its documents' predicted
    sensitivities.

    Args:
        estimator: a fitted :class:`~sparsebalance.batching.sparsity_estimator.SensitivityEstimator`.
        ref_topk, block_size: the budget its sensitivities were measured at.
        sources: [N] source tag of each document of the split (document id = index; None: untagged).
        compression: [N] compression ratio of each document (NaN: unknown; None: none).

    Fed from a sensitivity study (:meth:`from_study`); online, its estimator takes
    ``update_probe`` (a micro-batch's measured dense-minus-sparse loss), which the driver does
    not measure yet.
    """

    def __init__(self, estimator, *, ref_topk: int, block_size: int, sources=None,
                 compression=None) -> None:
        self.estimator, self.ref_topk, self.block_size = estimator, int(ref_topk), int(block_size)
        self.sources = None if sources is None else np.asarray(list(sources), dtype=object)
        self.compression = None if compression is None else np.asarray(compression, dtype=float)

    @classmethod
    def from_study(cls, study: dict, sources=None, compression=None) -> "SensitivityWeights":
        """Fitted on a sensitivity study's ``documents`` that carry ``loss_delta``
        (``source``, ``length``, optional ``compression_ratio``); its ``config`` gives the
        reference budget (``sens_topk``, ``block_size``; defaults 8 and 64)."""
        from sparsebalance.batching.sparsity_estimator import SensitivityEstimator

        docs = [d for d in study.get("documents", []) if d.get("loss_delta") is not None]
        if not docs:
            raise ValueError("the sensitivity study has no documents with a loss_delta")
        comp = [d.get("compression_ratio") for d in docs]
        est = SensitivityEstimator()
        est.update_many([d.get("source") for d in docs], [int(d["length"]) for d in docs],
                        [float(d["loss_delta"]) for d in docs], None,
                        comp if any(c is not None for c in comp) else None)
        cfg = study.get("config", {})
        return cls(est, ref_topk=int(cfg.get("sens_topk", 8)), block_size=int(cfg.get("block_size", 64)),
                   sources=sources, compression=compression)

    def documents(self, doc_ids, lengths) -> np.ndarray:
        """[n] predicted sensitivity (nats per token) of documents ``doc_ids`` of ``lengths``."""
        ids = np.asarray(doc_ids, dtype=np.int64)
        src = [None] * len(ids) if self.sources is None else list(self.sources[ids])
        comp = None if self.compression is None else self.compression[ids]
        return self.estimator.predict_many(src, lengths, comp)

    def __call__(self, packing, lengths: Lengths) -> np.ndarray:
        """[dp, M] weights of a step: ``packing`` (``StepPacking``: ``ranks[dp][M]`` segments
        ``(doc_id, offset, length)``) and its ``lengths`` as trained (a trailing padding
        segment gets sensitivity 0)."""
        from sparsebalance.tuning.sensitivity import microbatch_weights

        sens = []
        for r, rank in enumerate(packing.ranks):
            row = []
            for m, segs in enumerate(rank):
                s = list(self.documents([x[0] for x in segs], [x[2] for x in segs])) if segs else []
                row.append(s + [0.0] * (len(lengths[r][m]) - len(s)))
            sens.append(row)
        return microbatch_weights(lengths, sens, self.ref_topk, self.block_size)
