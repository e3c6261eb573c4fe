"""SparseBalance in the driver: predictor, per-step DST plan, online recalibration.

Per step, every rank runs the same deterministic code on the same inputs (no
communication beyond the per-step gather the loop does anyway):

1. the sampler's plan (all DP replicas' micro-batches) -> document lengths
   ``[dp][microbatch]`` (:func:`megatron.training.data.microbatch_lengths`);
2. with ``--sb-dst``: :func:`sparsebalance.tuning.from_predictor.build_instance` and
   the chosen planner -> ``budget[dp][microbatch][virtual stage]``, handed to the data
   iterators (``sparsebalance.tuning.hook``), so each micro-batch's budget for THIS
   stage is set before megatron's schedule runs its forward;
3. after the step, the gathered measured per-(micro-batch, stage) forward/backward
   times are folded into the predictor's per-(stage, phase) correction (one
   observation per (stage, phase) per step: the ratio of the step's measured sum to
   the uncalibrated model's sum), so the next step's plan adapts.

Planning ahead (the default under DST): the plan of step N+1 is built in a
background thread while step N trains (the sampler's next step is known in advance:
:meth:`megatron.training.data.PackedDataLoader.peek`), so planning is off the step's
critical path; measured on the 2-core CPU machine, planning in line cost ~2% of every
step, about as much as DST gains. The plan of step N+1 then uses the correction as of
the end of step N-1 (one step older), which is the same on every rank: the thread
starts after one observation and :meth:`Balancer.observe` waits for it before the
next, so budgets stay rank-identical.

Checkpoints (:meth:`Balancer.state_dict`) hold the correction and, for planning
ahead, the correction as it was before the last step's observation: the plan of the
first step after a resume is built from that one, exactly as the uninterrupted run's
background plan was, so budgets (and losses) continue bit for bit. A checkpoint
without this state (written before it was saved) or saved with another number of
(virtual) pipeline stages starts from the uncalibrated model, with one warning.

Data order does not depend on measurements: SAB packs with its own predictor
instance whose correction stays 1.0 (the plan is a function of (seed, step) only, as
Megatron users expect and resumption needs); run-time budgets do adapt.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


def model_config(args, vocab_size: int) -> dict:
    """:class:`sparsebalance.predictor.ModelShape` fields of the model being trained."""
    return dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups or args.num_attention_heads,
                ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
                vocab_size=vocab_size, swiglu=bool(args.swiglu), block_size=args.sb_block_size,
                topk=args.sb_topk if args.sparse_attention else None)


def attention_backend(args) -> str:
    """The kernel backend name this run resolves to (what profiles record)."""
    if not args.sparse_attention:
        return "sdpa"  # tools/profile_latency.py's name for the dense layer
    import torch
    from sparsebalance.ops import resolve_backend

    cuda = torch.cuda.is_available() and not args.cpu
    return resolve_backend(args.sb_attention_backend, torch.device("cuda" if cuda else "cpu"))


def build_predictor(args, vocab_size: int, warn=None):
    """The latency predictor of ``--sb-profile`` / ``--sb-cost-model`` (None if neither).

    Args:
        warn: called with each warning line (a stale profile under
            ``--sb-allow-stale-profile``); None drops them.

    Raises:
        FileNotFoundError: missing profile (the message holds the command that makes it).
        ValueError: stale or malformed profile, unknown model.
    """
    import warnings

    from sparsebalance.predictor import get_predictor

    cfg = model_config(args, vocab_size)
    # Under --context-parallel-size the predictor answers per-rank times of a CP group,
    # K/V exchange included (sparsebalance.predictor.context_parallel).
    cp = {"context_parallel_size": getattr(args, "context_parallel_size", 1)}
    if args.sb_cost_model is not None:
        return get_predictor(args.sb_cost_model, **cfg, **cp)
    if args.sb_profile is None:
        return None
    # Every model-fingerprint entry the profiler records, so a mismatch is caught and
    # the "create it" command of a missing profile reproduces this run's setup.
    expect = {"attention": "sparse" if args.sparse_attention else "dense",
              "attention_backend": attention_backend(args),
              "seq_length": args.seq_length, "normalization": args.normalization,
              "params_dtype": "bf16" if args.bf16 else "fp32"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pred = get_predictor(args.sb_profile, allow_stale=args.sb_allow_stale_profile,
                             expect=expect, **cfg, **cp)
    for w in caught:
        if warn is not None:
            warn(" ".join(str(w.message).split()))
    return pred


def stage_tables(predictor, lengths, topk: Optional[int], stages: int):
    """Calibrated forward/backward ms ``[dp, M, stages]`` of every micro-batch at one budget.

    ``lengths[dp][microbatch]`` are the micro-batch's segment lengths; vectorised like
    ``build_instance`` (one ``layer_doc_ms`` call per phase for the whole step).
    """
    D, M = len(lengths), len(lengths[0])
    docs = [np.asarray(lengths[d][m], dtype=np.int64) for d in range(D) for m in range(M)]
    flat = np.concatenate(docs)
    starts = np.cumsum([0] + [len(x) for x in docs[:-1]])
    layers = np.array([predictor.shape.layers_of(j, stages) for j in range(stages)], dtype=float)
    out = []
    for phase in ("fwd", "bwd"):
        per_layer = (np.add.reduceat(predictor.layer_doc_ms(flat, topk, phase), starts)
                     + predictor.layer_const_ms(phase))
        extras = np.zeros((D * M, stages))
        for j in {0, stages - 1}:
            extras[:, j] = [predictor.extras_ms(x, j, stages, phase) for x in docs]
        corr = np.array([predictor.correction(j, phase) for j in range(stages)])
        out.append(((per_layer[:, None] * layers + extras) * corr).reshape(D, M, stages))
    return out[0], out[1]


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


class Balancer:
    """Per-step DST planning and online recalibration on one rank (see module docstring).

    Args:
        args: parsed arguments (``--sb-dst``, ``--sb-anchor``, ``--sb-p``,
            ``--sb-topk[-min|-max]``, ``--sb-attn-slack``).
        predictor: LatencyPredictor whose correction this object updates.
        pad_to: micro-batch padding of the data loader (interleaved schedule).
    """

    def __init__(self, args, predictor, pad_to: Optional[int]) -> None:
        self.args = args
        self.ahead = args.sb_dst != "off" and args.sb_plan_ahead
        self.predictor = predictor
        self.pad_to = pad_to
        self.pp = args.pipeline_model_parallel_size
        self.vpp = args.virtual_pipeline_model_parallel_size or 1
        self.stages = self.pp * self.vpp
        self.schedule = "interleaved" if self.vpp > 1 else "1f1b"
        self.topk = args.sb_topk if args.sparse_attention else None
        self._pending: Optional[tuple] = None  # (batches, thread, result box) planned ahead
        # Recalibrator state before the last observe(): what a plan made ahead during the
        # last step read (saved so a resumed run plans its first step from it).
        self._before_last: dict = predictor.recalibrator.state_dict()
        self._resume_from: Optional[dict] = None  # set by load_state_dict, used once

    def lengths(self, plan) -> List[List[List[int]]]:
        """Segment lengths ``[dp][microbatch]`` of a sampler plan, as trained."""
        from megatron.training.data import microbatch_lengths

        return [[microbatch_lengths(mb, self.pad_to) for mb in rank] for rank in plan.ranks]

    def plan(self, batches) -> StepForecast:
        """Plan this step's budgets (sets ``batches.budget`` under DST) and predict it."""
        from sparsebalance.pipeline import simulate

        t0 = time.perf_counter()
        a, pred = self.args, self.predictor
        lengths = self.lengths(batches.plan)
        budget = None
        if a.sb_dst != "off":
            from sparsebalance.tuning import anchor_plan, critical_path_plan
            from sparsebalance.tuning.from_predictor import build_instance

            inst = build_instance(pred, lengths, pp=self.pp, vpp=self.vpp, schedule=self.schedule,
                                  k0=a.sb_topk, kmin=a.sb_topk_min, kmax=a.sb_topk_max)
            if a.sb_dst == "anchor":
                plan = anchor_plan(inst, agg=a.sb_anchor, p=a.sb_p)
            else:
                plan = critical_path_plan(inst, eps=a.sb_attn_slack)
            budget = plan.budget
            fwd, bwd, _ = inst.at(inst.indices(budget))
            step_ms, base_ms = plan.step_ms, plan.baseline_step_ms
            batches.budget = budget
        else:
            fwd, bwd = stage_tables(pred, lengths, self.topk, self.stages)
            step_ms = base_ms = simulate(fwd, bwd, schedule=self.schedule, vpp=self.vpp).step_ms
        corr = np.array([[pred.correction(s, ph) for s in range(self.stages)]
                         for ph in ("fwd", "bwd")])
        ms = (time.perf_counter() - t0) * 1e3
        return StepForecast(budget=budget, fwd_ms=np.asarray(fwd), bwd_ms=np.asarray(bwd),
                            step_ms=float(step_ms), baseline_step_ms=float(base_ms), plan_ms=ms,
                            model=(np.asarray(fwd) / corr[0], np.asarray(bwd) / corr[1]),
                            wait_ms=ms)

    def forecast(self, batches) -> StepForecast:
        """This step's plan: the one planned ahead for ``batches`` (waiting for it if
        it is not done), else planned now."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] is not batches:
            self._join(pending)
            if self._resume_from is not None:  # first step after a resume (see docstring)
                return self._plan_with(self._resume_from, batches)
            return self.plan(batches)
        t0 = time.perf_counter()
        out = self._join(pending)
        out.wait_ms = (time.perf_counter() - t0) * 1e3
        return out

    def plan_ahead(self, batches) -> None:
        """Start planning the next step's ``batches`` in the background (no-op unless
        planning ahead); :meth:`forecast` collects it."""
        if not self.ahead:
            return
        self._join(self._pending)
        box: dict = {}

        def work() -> None:
            try:
                box["out"] = self.plan(batches)
            except BaseException as e:  # re-raised on the training thread by _join
                box["err"] = e

        thread = threading.Thread(target=work, name="sb-plan-ahead", daemon=True)
        thread.start()
        self._pending = (batches, thread, box)

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

    def _plan_with(self, recal_state: dict, batches) -> StepForecast:
        """:meth:`plan` under another recalibrator state, then back to the current one
        (nothing else reads the predictor meanwhile: no plan is pending)."""
        current = self.predictor.recalibrator.state_dict()
        self.predictor.recalibrator.load_state_dict(recal_state)
        try:
            return self.plan(batches)
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


def op_times(calls: Sequence[float], phase: str, pp: int, pp_rank: int, microbatches: int,
             vpp: int) -> np.ndarray:
    """Per-call timer seconds of one phase on this rank -> ms ``[vpp, M]`` by (chunk,
    micro-batch), using megatron's op order (``sparsebalance.pipeline.rank_order``)."""
    from sparsebalance.pipeline import rank_order

    schedule = "interleaved" if vpp > 1 else "1f1b"
    ops = [(m, c) for ph, m, c in rank_order(schedule, pp, pp_rank, microbatches, vpp)
           if ph == phase]
    out = np.zeros((vpp, microbatches))
    if len(calls) != len(ops):
        raise RuntimeError(f"{len(calls)} timed {phase} calls on pipeline rank {pp_rank}, "
                           f"the schedule model expects {len(ops)}")
    for (m, c), sec in zip(ops, calls):
        out[c, m] = sec * 1e3
    return out
