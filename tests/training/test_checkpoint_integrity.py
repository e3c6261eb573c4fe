"""Checkpoint integrity (manifests, fallback, --keep-last, failed saves) through
pretrain_gpt.py, PP=2 over gloo.

* one uninterrupted 8-step run saves at 2, 4, 6, 8 with ``--keep-last 3`` (module
  fixture); the damaged checkpoints below are copies of its directories;
* a truncated shard of the latest checkpoint: one warning line, the run resumes from the
  older one and its losses equal the uninterrupted run's; every checkpoint damaged: one
  ``error:`` line and exit 1 on every rank;
* a deleted manifest, a flipped byte (same size), a missing file, ...: found by the
  check every load runs (in-process, no launch);
* a save that fails on one rank (disk full, permission denied; injected by this file's
  ``__main__``, which runs pretrain_gpt.py with one save made to fail): one ``error:``
  line on every rank, the previous checkpoint intact and loadable, no partial directory;
  with ``--continue-on-save-failure`` one warning and training goes on.

Constant LR so that runs of different --train-iters share the schedule. The runs that
train run in the session's warm world (tests/_world.py); those whose contract is the
exit and the one line of each rank, and the injected save failures (they patch torch's
own writers, which a warm worker does not put back), are processes.
"""

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import PRETRAIN, ROOT, TINY, command, env, summary_of

sys.path.insert(0, ROOT)
from megatron.training import checkpointing as ckpt  # noqa: E402

PP2 = ["--pipeline-model-parallel-size", "2", "--lr-decay-style", "constant",
       "--override-opt_param-scheduler"]  # Megatron-LM's rule: resumes change --train-iters
TOTAL = 8
FAIL_SAVE = "SB_TEST_FAIL_SAVE"  # "<iteration>:<rank>:<errno name>", read by __main__ below


def _name(iteration):
    return os.path.basename(ckpt.iter_dir("", iteration))


def _copy(save, dest, iterations):
    """A --load directory holding copies of ``iterations`` of ``save``, tracker at the last."""
    os.makedirs(dest)
    for i in iterations:
        shutil.copytree(ckpt.iter_dir(save, i), ckpt.iter_dir(str(dest), i))
    open(os.path.join(dest, ckpt.TRACKER), "w").write(f"{iterations[-1]}\n")
    return str(dest)


def _flip_byte(path, offset=100):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(script, args, extra_env=None, timeout=180):
    """Both ranks started by hand (not torchrun, whose own traceback on a failed child
    would hide theirs); returns [(returncode, stdout, stderr)] in rank order."""
    port, procs = _port(), []
    for rank in range(2):
        e = env()
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), **(extra_env or {}))
        procs.append(subprocess.Popen(command(script, args), cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _losses(stdout):
    line = next(ln for ln in stdout.splitlines() if "SUMMARY_JSON " in ln)
    return json.loads(line.split("SUMMARY_JSON ", 1)[1])["losses"]


def _one_line(stderr, word):
    """The only line of ``stderr`` containing ``word`` (there must be exactly one)."""
    lines = [ln for ln in stderr.splitlines() if word in ln]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory, world):
    save = str(tmp_path_factory.mktemp("full"))
    summary = summary_of(world.launch(PRETRAIN, [*TINY, *PP2, "--data-path", corpus, "--train-iters", str(TOTAL),
                                                 "--save", save, "--save-interval", "2", "--keep-last", "3"],
                                      nproc=2))
    assert len(set(np.round(summary["losses"], 4))) == TOTAL  # the curve really moves
    return summary["losses"], save


def test_manifest_and_keep_last(full_run):
    _, save = full_run
    assert sorted(os.listdir(save)) == [_name(4), _name(6), _name(8), ckpt.TRACKER]  # 2 rotated out
    for i in (4, 6, 8):
        path = ckpt.iter_dir(save, i)
        doc = json.load(open(os.path.join(path, ckpt.MANIFEST)))
        assert doc["format"] == ckpt.MANIFEST_FORMAT and doc["iteration"] == i
        assert sorted(doc["files"]) == sorted(f for f in os.listdir(path) if f != ckpt.MANIFEST)
        assert {"__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"} <= set(doc["files"])
        for f, entry in doc["files"].items():
            assert entry["size"] == os.path.getsize(os.path.join(path, f))
            assert entry["sha256"] == ckpt._digest(os.path.join(path, f))
        assert ckpt.check_checkpoint(path, i) is None


DAMAGE = {
    # name: (what is done to iter_0000008, the reason check_checkpoint gives)
    "truncated shard": (lambda p: os.truncate(os.path.join(p, "__1_0.distcp"), 1000),
                        r"__1_0\.distcp has 1000 bytes, manifest says \d+"),
    "deleted manifest": (lambda p: os.remove(os.path.join(p, ckpt.MANIFEST)), r"^no manifest\.json$"),
    "flipped byte": (lambda p: _flip_byte(os.path.join(p, "__0_0.distcp")), r"__0_0\.distcp fails its sha256"),
    "missing file": (lambda p: os.remove(os.path.join(p, "common.pt")), r"^common\.pt missing$"),
    "garbage manifest": (lambda p: open(os.path.join(p, ckpt.MANIFEST), "w").write("{ not json"),
                         r"manifest\.json unreadable"),
    "manifest of another iteration": (
        lambda p: shutil.copy(os.path.join(p, "..", _name(6), ckpt.MANIFEST), os.path.join(p, ckpt.MANIFEST)),
        r"manifest\.json is for iteration 6"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_damage_is_found_and_skipped(full_run, tmp_path, damage):
    """In-process (one rank): the check every load runs, and the choice it leads to."""
    _, save = full_run
    root = _copy(save, tmp_path / "ck", [6, 8])
    do, reason = DAMAGE[damage]
    do(ckpt.iter_dir(root, 8))
    assert re.search(reason, ckpt.check_checkpoint(ckpt.iter_dir(root, 8), 8)), damage
    warnings = []
    assert ckpt.choose_checkpoint(root, warnings.append) == 6
    assert len(warnings) == 1 and re.fullmatch(
        r"checkpoint iter_0000008 is damaged \(.*\); loading iter_0000006", warnings[0]), warnings


def test_hashing_is_split_between_ranks(full_run, tmp_path):
    _, save = full_run
    root = _copy(save, tmp_path / "ck", [8])
    _flip_byte(os.path.join(ckpt.iter_dir(root, 8), "__0_0.distcp"))
    found = [ckpt.check_checkpoint(ckpt.iter_dir(root, 8), 8, share=r, shares=2) for r in range(2)]
    assert sum(f is not None for f in found) == 1, found  # exactly one rank reads that file


def test_checkpoints_without_manifests(full_run, tmp_path):
    """Saved before manifests: loaded unverified (one warning) when no checkpoint in the
    directory has a manifest; once one has, a missing manifest means damaged."""
    _, save = full_run
    root = _copy(save, tmp_path / "old", [6, 8])
    for i in (6, 8):
        os.remove(os.path.join(ckpt.iter_dir(root, i), ckpt.MANIFEST))
    warnings = []
    assert ckpt.choose_checkpoint(root, warnings.append) == 8
    assert len(warnings) == 1 and "has no manifest.json" in warnings[0] and "unverified" in warnings[0]
    mixed = _copy(save, tmp_path / "mixed", [6, 8])
    os.remove(os.path.join(ckpt.iter_dir(mixed, 8), ckpt.MANIFEST))
    assert ckpt.choose_checkpoint(mixed, warnings.append) == 6


def test_truncated_shard_falls_back_and_resumes(corpus, full_run, tmp_path, world):
    full, save = full_run
    root = _copy(save, tmp_path / "ck", [6, 8])
    subprocess.run(["truncate", "-s", "1000", os.path.join(ckpt.iter_dir(root, 8), "__1_0.distcp")], check=True)
    proc = world.launch(PRETRAIN, [*TINY, *PP2, "--data-path", corpus, "--train-iters", "10", "--load", root],
                        nproc=2)
    resumed = summary_of(proc)
    line = _one_line(proc.stderr, "warning:")
    assert line.endswith("warning: checkpoint iter_0000008 is damaged (__1_0.distcp has 1000 bytes, "
                         f"manifest says {os.path.getsize(os.path.join(save, _name(8), '__1_0.distcp'))}); "
                         "loading iter_0000006"), line
    assert resumed["iterations"] == 4 and resumed["last_iteration"] == 10
    np.testing.assert_allclose(resumed["losses"][:2], full[6:], rtol=1e-6)


def test_all_damaged_is_one_error_on_every_rank(corpus, full_run, tmp_path):
    _, save = full_run
    root = _copy(save, tmp_path / "ck", [6, 8])
    os.truncate(os.path.join(ckpt.iter_dir(root, 8), "__1_0.distcp"), 1000)
    _flip_byte(os.path.join(ckpt.iter_dir(root, 6), "__1_0.distcp"))
    for rank, (rc, _, err) in enumerate(_two_ranks(PRETRAIN, [*TINY, *PP2, "--data-path", corpus,
                                                              "--train-iters", "10", "--load", root])):
        assert rc == 1, err[-3000:]
        line = _one_line(err, "error:")
        assert f"[rank {rank}] --load: no intact checkpoint in {root}: iter_0000008 is damaged" in line
        assert "iter_0000006 is damaged (__1_0.distcp fails its sha256 check)" in line
        assert "warning:" not in err


def _fail_at(corpus, save, spec, *extra):
    return _two_ranks(__file__, [*TINY, *PP2, "--data-path", corpus, "--train-iters", "6", "--save", save,
                                 "--save-interval", "2", *extra], extra_env={FAIL_SAVE: spec})


def test_failed_save_stops_and_keeps_the_previous_checkpoint(corpus, full_run, tmp_path, world):
    full, _ = full_run
    save = str(tmp_path / "ck")
    for rank, (rc, _, err) in enumerate(_fail_at(corpus, save, "4:1:ENOSPC")):  # rank 1's shard
        assert rc == 1, err[-3000:]
        line = _one_line(err, "error:")
        assert f"[rank {rank}] saving checkpoint iter_0000004 to {save} failed: [Errno 28] No space left " \
               f"on device: '{save}/iter_0000004.tmp-" in line, line
    assert sorted(os.listdir(save)) == [_name(2), ckpt.TRACKER]  # no partial directory
    assert ckpt.read_tracker(save) == 2 and ckpt.check_checkpoint(ckpt.iter_dir(save, 2), 2) is None
    proc = world.launch(PRETRAIN, [*TINY, *PP2, "--data-path", corpus, "--train-iters", "4", "--load", save],
                        nproc=2)
    np.testing.assert_allclose(summary_of(proc)["losses"], full[2:4], rtol=1e-6)
    assert "warning:" not in proc.stderr


def test_continue_on_save_failure(corpus, full_run, tmp_path):
    full, _ = full_run
    save = str(tmp_path / "ck")
    (rc0, out0, err0), (rc1, _, err1) = _fail_at(corpus, save, "4:0:EACCES", "--continue-on-save-failure")
    assert rc0 == 0 and rc1 == 0, err0[-3000:] + err1[-3000:]
    line = _one_line(err0, "warning:")
    assert f"warning: saving checkpoint iter_0000004 to {save} failed: [Errno 13] Permission denied: " \
           f"'{save}/iter_0000004.tmp-" in line and line.endswith("training continues (--continue-on-save-failure)")
    assert "warning:" not in err1 and "error:" not in err0 + err1
    np.testing.assert_allclose(_losses(out0), full[:6], rtol=1e-6)  # training went on unchanged
    assert sorted(os.listdir(save)) == [_name(2), _name(6), ckpt.TRACKER]
    assert ckpt.read_tracker(save) == 6


def test_keep_last_rules(tmp_path):
    """remove_old_checkpoints on made-up checkpoints: keeps the newest N intact ones and
    everything newer; fewer than N intact: deletes nothing; never a .tmp- directory."""
    root = str(tmp_path)

    def make(i, damaged=False):
        path = ckpt.iter_dir(root, i)
        os.makedirs(path)
        open(os.path.join(path, "shard"), "wb").write(bytes(range(i + 10)))
        ckpt.write_manifest(path, i, ckpt._describe(path, ["shard"]))
        if damaged:
            os.truncate(os.path.join(path, "shard"), 3)

    for i in (1, 2, 3, 5, 7):
        make(i)
    make(4, damaged=True)
    make(6, damaged=True)
    make(9)  # newer than the one "just saved" (7): not ours to judge
    os.makedirs(ckpt.iter_dir(root, 8) + ".tmp-abcd1234")
    assert ckpt.remove_old_checkpoints(root, 2, newest=7) == [_name(1), _name(2), _name(3), _name(4)]
    assert sorted(os.listdir(root)) == [_name(5), _name(6), _name(7), _name(8) + ".tmp-abcd1234", _name(9)]
    assert ckpt.remove_old_checkpoints(root, 3, newest=7) == []  # only 2 intact at or below 7
    assert ckpt.remove_old_checkpoints(root, 1, newest=7) == [_name(5), _name(6)]
    assert ckpt.remove_old_checkpoints(root, 1, newest=7) == []  # the only intact one stays
    assert sorted(os.listdir(root)) == [_name(7), _name(8) + ".tmp-abcd1234", _name(9)]


def _inject_save_failure(spec: str) -> None:
    """Make the save at iteration ``it`` fail on rank ``rank`` with ``errno``: rank 0 in its
    common.pt, any other rank in its own shard file (torch.distributed.checkpoint)."""
    import torch
    from torch.distributed.checkpoint import filesystem

    it, rank, name = spec.split(":")
    code = getattr(errno, name)
    tag = f"{_name(int(it))}.tmp-"

    def refuse(path):
        raise OSError(code, os.strerror(code), str(path))

    if int(rank) != int(os.environ["RANK"]):
        return
    if int(rank) == 0:
        save = torch.save
        torch.save = lambda obj, f, *a, **k: refuse(f) if tag in str(f) else save(obj, f, *a, **k)
    else:
        write = filesystem.FileSystemWriter.write_data
        filesystem.FileSystemWriter.write_data = lambda self, plan, planner: (
            refuse(os.path.join(self.path, f"__{rank}_0.distcp")) if tag in str(self.path)
            else write(self, plan, planner))


if __name__ == "__main__":  # pretrain_gpt.py with one save made to fail (see _fail_at)
    _inject_save_failure(os.environ[FAIL_SAVE])
    sys.path.insert(0, ROOT)
    import pretrain_gpt

    sys.exit(pretrain_gpt.main(sys.argv[1:]))
