"""Megatron-LM main's ``--step-batch-size-schedule`` as ``pretrain_gpt.py`` resolves it: the
batch of every iteration, the number of iterations, the evaluation batch and the LR schedule
equal Megatron-LM's (parse only). The reference below is written from Megatron-LM's source
(``megatron/core/num_microbatches_calculator.py``: ``StepBatchsizeNumMicroBatchesCalculator``;
``megatron/training/training.py``: ``update_train_iters``, ``get_optimizer_param_scheduler``;
``megatron/training/arguments.py``: the global-batch default), not from the code under test.
"""

import pytest
import torch
from conftest import parsed, refused_line

QUIET = ["--mock-data", "--tokenizer-type", "ByteTokenizer", "--transformer-impl", "local", "--lr", "1e-3",
         "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--weight-decay-incr-style", "linear",
         "--start-weight-decay", "0.01", "--end-weight-decay", "0.1"]


def _number(text):
    units = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
    text = text.upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(float(text))


def upstream_batches(schedule, seq_length, train_iters=None, train_samples=None):
    """Megatron-LM's global batch of each iteration: thresholds are tokens, // seq_length
    samples; before each iteration the batch is the last entry whose threshold the consumed
    samples reach; with --train-samples, iterations run while fewer were consumed."""
    entries = sorted((_number(t) // seq_length, _number(b))
                     for t, b in (w.split(":") for w in schedule.replace(",", " ").split()))
    batches, consumed = [], 0
    while len(batches) < train_iters if train_iters is not None else consumed < train_samples:
        batches.append([b for t, b in entries if consumed >= t][-1])
        consumed += batches[-1]
    return batches


def resolve(*flags, world_size=1):
    return parsed(QUIET, *flags, world_size=world_size)


def refused(capsys, *flags, world_size=1):
    return refused_line(capsys, QUIET, *flags, world_size=world_size)


def test_release_config_trains_its_first_batch_throughout():
    """Megatron-LM's gpt3_15b_8t_release schedule: 80B tokens of training never reach 200B."""
    schedule, seq, samples = "0:384 200B:768 400B:1152", 4096, 19531250
    args = resolve("--step-batch-size-schedule", schedule, "--seq-length", str(seq), "--train-samples", str(samples),
                   "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252")
    want = upstream_batches(schedule, seq, train_samples=samples)
    assert args.train_iters == len(want) == 50863  # the last iteration passes --train-samples, as upstream's loop
    assert set(want) == {args.global_batch_size} == {384}
    assert args.batch_schedule == [(0, 384), (48828125, 768), (97656250, 1152)]


@pytest.mark.parametrize("schedule,seq,iters", [
    ("0:8, 1K:16", 64, 2),      # commas separate entries; 1000 tokens = 15 samples, reached at iteration 3
    ("1K:16 0:8", 64, 2),       # entries in any order
    ("63:4 640:8", 64, 3),      # 63 tokens are 0 samples: the first entry; 640 are 10, reached at iteration 4
    ("0:8 1M:16", 256, 489),    # 3906 samples: iteration 489 starts after 3904
])
def test_accepted_schedules_train_upstreams_batches(schedule, seq, iters):
    args = resolve("--step-batch-size-schedule", schedule, "--seq-length", str(seq), "--train-iters", str(iters))
    assert upstream_batches(schedule, seq, train_iters=iters) == [args.global_batch_size] * args.train_iters


@pytest.mark.parametrize("schedule,seq,iters", [("0:8, 1K:16", 64, 3), ("0:2 64:4", 64, 2), ("0:8 1M:16", 256, 490),
                                                ("63:4 640:8", 64, 4)])
def test_a_run_reaching_the_next_threshold_is_refused_where_upstream_changes_the_batch(capsys, schedule, seq, iters):
    want = upstream_batches(schedule, seq, train_iters=iters)
    change = next(i for i, b in enumerate(want) if b != want[0]) + 1
    line = refused(capsys, "--step-batch-size-schedule", schedule, "--seq-length", str(seq),
                   "--train-iters", str(iters))
    assert f"would change from {want[0]} to {want[change - 1]} at iteration {change} " in line, line
    assert "a batch that changes during the run is not supported" in line


@pytest.mark.parametrize("schedule,says", [
    ("64:8", "the first entry must start at 0"),             # 64 tokens = 1 sample
    ("0:8 10:16", "thresholds must be strictly increasing"),  # 10 tokens = 0 samples
    ("0:0", "batch size 0 is not positive"),
    ("0:eight", "'0:eight' is not THRESHOLD:BATCH"),
    ("0-8", "'0-8' is not THRESHOLD:BATCH"),
])
def test_upstreams_schedule_rules(capsys, schedule, says):
    line = refused(capsys, "--step-batch-size-schedule", schedule, "--seq-length", "64")
    assert says in line, line


def test_evaluation_batch_defaults_to_micro_batch_times_dp():
    """Megatron-LM sets its args.global_batch_size to micro-batch x DP under a schedule, and the
    evaluation batch defaults to it."""
    args = resolve("--step-batch-size-schedule", "0:8", "--train-iters", "2", world_size=2)
    assert (args.global_batch_size, args.num_microbatches) == (8, 4)
    assert (args.eval_global_batch_size, args.eval_num_microbatches) == (2, 1)
    given = resolve("--step-batch-size-schedule", "0:8", "--eval-global-batch-size", "8", world_size=2)
    assert given.eval_num_microbatches == 4
    plain = resolve("--global-batch-size", "8", world_size=2)
    assert plain.eval_global_batch_size == 8


def _schedules(args, upstream_kwargs, increment):
    """This driver's scheduler (stepped once per iteration) and Megatron-LM's (in samples)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron.training.lr_schedule import scheduler_kwargs

    def sched(kwargs):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return OptimizerParamScheduler(opt, **kwargs), opt

    ours, our_opt = sched(scheduler_kwargs(args))
    theirs, their_opt = sched(dict(init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", start_wd=0.01,
                                   end_wd=0.1, wd_incr_style="linear", **upstream_kwargs))
    rows = []
    for _ in range(args.train_iters):
        ours.step(1)
        theirs.step(increment)
        rows.append((our_opt.param_groups[0]["lr"], their_opt.param_groups[0]["lr"],
                     our_opt.param_groups[0]["weight_decay"], their_opt.param_groups[0]["weight_decay"]))
    return rows


def test_lr_schedule_with_train_iters_counts_micro_batch_times_dp_samples():
    """get_optimizer_param_scheduler: lengths = --lr-*-iters x args.global_batch_size (micro-batch
    x DP = 2 here), stepped by the 8 samples of each iteration: the LR runs 4x its flags; one
    warning line says so."""
    args = resolve("--step-batch-size-schedule", "0:8", "--train-iters", "12", "--lr-decay-iters", "24",
                   "--lr-warmup-iters", "4", world_size=2)
    rows = _schedules(args, dict(lr_warmup_steps=4 * 2, lr_decay_steps=24 * 2, wd_incr_steps=12 * 2), 8)
    for lr, want_lr, wd, want_wd in rows:
        assert lr == pytest.approx(want_lr, rel=1e-12, abs=1e-15) and wd == pytest.approx(want_wd, rel=1e-12)
    assert rows[-1][1] == pytest.approx(1e-4)  # upstream's run ends decayed: 12 x 8 samples > 24 x 2
    assert len([w for w in args.compat_warnings if "counts the --lr-*-iters lengths" in w]) == 1


def test_lr_schedule_with_train_samples_counts_the_schedules_samples():
    args = resolve("--step-batch-size-schedule", "0:8", "--train-samples", "84", "--lr-decay-samples", "64",
                   "--lr-warmup-samples", "16", world_size=2)
    assert args.train_iters == len(upstream_batches("0:8", 1024, train_samples=84)) == 11
    rows = _schedules(args, dict(lr_warmup_steps=16, lr_decay_steps=64, wd_incr_steps=84), 8)
    for lr, want_lr, wd, want_wd in rows:
        assert lr == pytest.approx(want_lr, rel=1e-12, abs=1e-15) and wd == pytest.approx(want_wd, rel=1e-12)
    assert not [w for w in args.compat_warnings if "--lr-*-iters" in w]


def test_rampup_batch_size_is_accepted_without_effect_as_upstream():
    """Megatron-LM main parses --rampup-batch-size and reads it nowhere (deprecated): the batch
    stays --global-batch-size; here too, with one warning line."""
    args = resolve("--global-batch-size", "8", "--rampup-batch-size", "2", "2", "100", world_size=2)
    assert args.global_batch_size == 8 and args.num_microbatches == 4
    assert len([w for w in args.compat_warnings if "--rampup-batch-size" in w]) == 1
