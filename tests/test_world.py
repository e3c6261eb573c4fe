"""The tests' warm worlds (tests/_world.py): a job sees what a fresh process would.

A job that monkeypatches the library, sets globals and environment, installs a
signal handler or registers an exit function leaves nothing of it to the next job;
a job whose rank dies fails as under torchrun and the next job gets a fresh world.
"""

import json
import textwrap

PROBE = textwrap.dedent('''
    import atexit, json, os, signal, sys
    import sparsebalance.attention.sparse as S
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.training import model
    print("PROBE " + json.dumps({
        "attend": S.SparseAttention._attend.__qualname__, "rng_patched": list(model._CPU_RECOMPUTE_RNG),
        "rng_getter": mrandom._get_cuda_rng_state.__qualname__, "env": os.environ.get("SB_WORLD_PROBE"),
        "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
        "handler": str(signal.getsignal(signal.SIGTERM)), "pid": os.getpid()}))
    if sys.argv[1] == "patch":
        S.SparseAttention._attend = lambda *a: None
        model.install_cpu_recompute_rng()
        os.environ["SB_WORLD_PROBE"] = "leaked"
        signal.signal(signal.SIGTERM, lambda *a: None)
        atexit.register(print, "EXIT-HOOK", file=sys.stderr)
    if sys.argv[1] == "die":
        import torch
        torch.distributed.init_process_group("gloo")
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.barrier()
    raise SystemExit(3 if sys.argv[1] == "fail" else 0)
''')


def _probes(job):
    return [json.loads(out.split("PROBE ", 1)[1].splitlines()[0]) for _, out, _ in job.ranks]


def test_a_job_leaves_nothing_to_the_next(world, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    first = world.launch(str(script), ["patch"], nproc=2)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("EXIT-HOOK") == 2  # exit functions ran at the job's end
    second = world.launch(str(script), ["look"], nproc=2)
    assert second.returncode == 0, second.stderr
    before, after = _probes(first), _probes(second)
    assert [p["rank"] for p in after] == ["0", "1"] and {p["world"] for p in after} == {"2"}
    assert [p["pid"] for p in after] == [p["pid"] for p in before]  # the same warm processes
    for b, a in zip(before, after):
        for key in ("attend", "rng_patched", "rng_getter", "env", "handler"):
            assert a[key] == b[key], key
    assert after[0]["attend"] == "SparseAttention._attend" and after[0]["env"] is None
    assert after[0]["rng_patched"] == [] and after[0]["rng_getter"] == "_get_cuda_rng_state"


def test_exit_status_and_a_dead_rank_end_the_job_not_the_session(world, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    assert world.launch(str(script), ["fail"], nproc=1).returncode == 3
    died = world.launch(str(script), ["die"], nproc=2, timeout=120)
    assert died.ranks[1][0] == -9 and died.ranks[0][0] != 0, died.stderr[-2000:]
    again = world.launch(str(script), ["look"], nproc=2)
    assert again.returncode == 0, again.stderr
    assert all(p["pid"] != q["pid"] for p, q in zip(_probes(again), _probes(died)))  # a fresh world
