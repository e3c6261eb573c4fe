"""pretrain_gpt.py with deterministic "measured" op times and fault hooks, for the
resume, watchdog and fault-injection tests (tests/training/test_exact_resume.py,
tests/training/test_watchdog.py, benchmarks/fault_trials.py).

Runs ``pretrain_gpt.main()`` (so errors end in its one ``error:`` line) after
monkeypatching, as told by environment variables (test-only; the driver has no such
flags):

``SB_TEST_DUMP=DIR``
    append one JSON line per step to ``DIR/rank<r>.jsonl``: iteration, this rank's
    loss sum and tokens, the DST budget table, the budget of every attention call, the
    packing (every DP rank's segments) and the sampler state after the step; plus a
    ``{"loaded": iteration}`` line when the run resumed from a checkpoint.
``SB_TEST_DET_TIMES=1``
    the measured op times the balancer folds into its correction become a
    deterministic function of (iteration, stage, micro-batch) times the predictor's
    own uncalibrated model (:func:`_det_factor`), so two runs (or a run and its resume)
    see the same "measurements" and DST budgets are comparable bit for bit.
``SB_TEST_DROP_SB_STATE=1``
    load checkpoints as if written before the predictor state was saved (its
    ``sparsebalance`` entry is dropped from what is read): the control that shows the
    exact-resume test can fail, and the old-checkpoint path.
``SB_TEST_HANG=RANK:ITER``
    global rank RANK sleeps forever inside step ITER (1-based), before its schedule
    runs (the watchdog test).
``SB_TEST_KILL=RANK:PHASE:ITER:N``
    global rank RANK SIGKILLs itself at its N-th (1-based) entry into PHASE during
    iteration ITER (1-based step number; for ``checkpoint``, the save after step
    ITER). PHASE is one of ``forward`` (a micro-batch's forward step), ``p2p`` (a
    pipeline send/receive), ``optimizer`` (the optimizer step) or ``checkpoint``
    (inside the save, after this rank's shards are written, before the manifest).
``SB_TEST_TERM=RANK:ITER``
    global rank RANK sends itself SIGTERM as step ITER (1-based) starts, as a
    scheduler preempting the job would (with ``--exit-signal-handler`` the run
    finishes that step, saves and exits 0).
"""

import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PHASES = ("forward", "p2p", "optimizer", "checkpoint")


def _det_factor(iteration: int, stage: int, microbatch: int, phase: str) -> float:
    """measured / model of one op: in [0.5, 2.0], changing with the step and the stage,
    so the per-stage correction (and with it the DST budgets) moves every step."""
    k = (3 * iteration + 5 * stage + microbatch + (2 if phase == "bwd" else 0)) % 7
    return 0.5 + 0.25 * k


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _install_kill(spec: str) -> None:
    rank, phase, iteration, nth = spec.split(":")
    if int(rank) != _rank():
        return
    assert phase in PHASES, phase
    iteration, nth = int(iteration), int(nth)
    count = {}

    def hit() -> None:
        it = _current[0]
        count[it] = count.get(it, 0) + 1
        if it == iteration and count[it] == nth:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn, before=True):
        def inner(*a, **k):
            if before:
                hit()
                return fn(*a, **k)
            out = fn(*a, **k)
            hit()
            return out
        return inner

    if phase == "forward":
        from megatron.training import step

        step.forward_step = wrap(step.forward_step)
    elif phase == "p2p":
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        P2PCommunicator._communicate = wrap(P2PCommunicator._communicate)
    elif phase == "optimizer":
        from megatron.training import model

        build = model.build_optimizer

        def build_optimizer(*a, **k):
            optimizer, scheduler = build(*a, **k)
            optimizer.step = wrap(optimizer.step)
            return optimizer, scheduler

        model.build_optimizer = build_optimizer
    else:
        from megatron.training import checkpointing

        checkpointing._write_state = wrap(checkpointing._write_state, before=False)


def _install_step_counter() -> None:
    """Keep ``_current[0]`` = the 1-based number of the step running (or just run)."""
    from megatron.training import step

    train_step = step.train_step

    def counted(*a, **k):
        _current[0] = max(_current[0], _loaded_iteration[0]) + 1
        return train_step(*a, **k)

    step.train_step = counted  # pretrain() imports it from step at call time


def _install_at_step(spec: str, action) -> None:
    """``RANK:ITER``: global rank RANK runs ``action()`` as step ITER starts."""
    rank, iteration = (int(x) for x in spec.split(":"))
    if rank != _rank():
        return
    from megatron.training import step

    train_step = step.train_step

    def hooked(*a, **k):
        if _current[0] == iteration:
            action()
        return train_step(*a, **k)

    step.train_step = hooked  # pretrain() imports it from step at call time


def _hang_forever() -> None:
    while True:
        time.sleep(3600)


_loaded_iteration = [0]
_current = [0]


def _install_load_probe(dump) -> None:
    from megatron.training import checkpointing

    load = checkpointing.load_checkpoint

    if os.environ.get("SB_TEST_DROP_SB_STATE") == "1":
        read = checkpointing._load

        def old_format_load(*a, **k):
            loaded = read(*a, **k)
            loaded.pop("sparsebalance", None)
            return loaded

        checkpointing._load = old_format_load

    def load_checkpoint(*a, **k):
        it = load(*a, **k)
        _loaded_iteration[0] = it
        if dump is not None:
            dump({"loaded": it})
        return it

    checkpointing.load_checkpoint = load_checkpoint


def _install_det_times() -> None:
    import numpy as np

    from sparsebalance.balancer import Balancer

    observe = Balancer.observe

    def det_observe(self, forecast, measured_fwd_ms, measured_bwd_ms):
        it = _current[0]
        out = []
        for phase, model in (("fwd", forecast.model[0]), ("bwd", forecast.model[1])):
            D, M, S = model.shape
            f = np.array([[[_det_factor(it, s, m, phase) for s in range(S)] for m in range(M)]
                          for _ in range(D)])
            out.append(np.asarray(model) * f)
        return observe(self, forecast, out[0], out[1])

    Balancer.observe = det_observe


def main() -> int:
    dump_dir = os.environ.get("SB_TEST_DUMP")
    dump = None
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        path = os.path.join(dump_dir, f"rank{_rank()}.jsonl")

        def dump(obj) -> None:
            with open(path, "a") as f:
                f.write(json.dumps(obj) + "\n")

    _install_load_probe(dump)
    if os.environ.get("SB_TEST_DET_TIMES") == "1":
        _install_det_times()
    if os.environ.get("SB_TEST_HANG"):
        _install_at_step(os.environ["SB_TEST_HANG"], _hang_forever)
    if os.environ.get("SB_TEST_KILL"):
        _install_kill(os.environ["SB_TEST_KILL"])
    if os.environ.get("SB_TEST_TERM"):
        _install_at_step(os.environ["SB_TEST_TERM"], lambda: os.kill(os.getpid(), signal.SIGTERM))
    _install_step_counter()  # outermost: the hooks above see the step number already moved

    from megatron.training import data, training

    if dump is not None:
        next_step, last = data.PackedDataLoader.next_step, {}

        def recording_next_step(self, *args, **kwargs):
            last["batches"] = next_step(self, *args, **kwargs)
            return last["batches"]

        data.PackedDataLoader.next_step = recording_next_step
        pretrain = training.pretrain

        def on_step(iteration, state, result):
            packing = last["batches"].packing
            dump({
                "iteration": iteration, "loss_sum": result.loss_sum, "loss_tokens": result.loss_tokens,
                "budget": None if result.budget is None else [[list(map(int, s)) for s in m]
                                                              for m in result.budget],
                "records": [[r.layer_number, r.microbatch, r.topk] for r in result.attention_records],
                "packing": [[[list(map(int, seg)) for seg in mb] for mb in rank] for rank in packing.ranks],
                "sampler": state.loader.state_dict(),
            })

        training.pretrain = lambda args: pretrain(args, on_step=on_step)

    import pretrain_gpt

    return pretrain_gpt.main()


if __name__ == "__main__":
    sys.exit(main())
