"""tools/checkpoint/convert.py against transformers on tiny random Llama / Qwen2 models.

* HF -> ours: our GPTModel's logits (packed THD, two documents) equal transformers'
  per-document logits within 1e-4 (fp32, CPU).
* HF -> ours -> HF is bit-exact per tensor and loads with AutoModelForCausalLM.
* ``pretrain_gpt.py --load CKPT --finetune`` starts from the converted checkpoint
  (PP=1, PP=2, PP=2 x VPP=2 interleaved, TP=2; embeddings tied or not), and its first-step loss equals
  transformers' loss on the same documents within 1e-4.

The commands run in the session's warm world (tests/_world.py) but the defective
inputs' conversions: their contract is the process (exit 2, one line, nothing written).
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _hf_models import make_hf  # noqa: E402

CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
WORKER = os.path.join(HERE, "_logits_worker.py")
CONFIGS = {  # name -> (arch, tied embeddings, shard size of the HF files in KB or None, layers)
    "qwen2-tied-sharded": ("qwen2", True, 60, 2),
    "qwen2-untied": ("qwen2", False, None, 2),
    "llama-untied-sharded": ("llama", False, 60, 2),  # with Llama 3.1 RoPE scaling
    "llama-4-layers": ("llama", False, None, 4),  # for interleaved virtual stages
}
VOCAB = 160
DOCS = [(0, 17), (17, 40), (40, 64)]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def start_all(*argvs):
    """``python *argv`` of each command, all started at once (one thread a process: on the
    2-core machine they overlap); :func:`results` waits for them."""
    procs = []
    for argv in argvs:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # no pipe to fill
        procs.append((subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env(), stdout=out, stderr=err,
                                       text=True), out, err))
    return procs


def results(procs, timeout=240):
    """The ``subprocess.CompletedProcess`` of each of :func:`start_all`'s, in order."""
    done = []
    try:
        for proc, out, err in procs:
            proc.wait(timeout=timeout)
            out.seek(0)
            err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
    finally:  # a timeout: none is left running
        for proc, out, err in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()
            err.close()
    return done


@pytest.fixture(scope="module")
def conversions(tmp_path_factory, world):
    """Every ``convert.py hf-to-megatron`` of the module but the recipe's: the
    tiny models of :data:`CONFIGS` (``"models"``: name -> (its directory, holding ``hf/``
    and the ``ckpt/`` written, the HF model, the result)) and the defective inputs of
    :data:`BAD_INPUTS` (``"bad"``: a list of (its directory, holding only ``hf/`` before
    the conversion; the result))."""
    from _hf_models import write_plain_hf

    made, bad = {}, []
    for name, (arch, tied, shard_kb, layers) in CONFIGS.items():
        d = tmp_path_factory.mktemp(name)
        made[name] = (d, make_hf(str(d / "hf"), arch, tied=tied, vocab=VOCAB, shard_kb=shard_kb, layers=layers))
        if shard_kb:
            assert os.path.isfile(d / "hf" / "model.safetensors.index.json")
    for defect, _ in BAD_INPUTS:
        d = tmp_path_factory.mktemp("bad")
        write_plain_hf(str(d / "hf"), **defect)
        bad.append(d)
    failing = start_all(*([CONVERT, "hf-to-megatron", "--hf-dir", str(d / "hf"), "--output", str(d / "out")]
                          for d in bad))  # processes, alongside the world's jobs
    procs = [world.launch(CONVERT, ["hf-to-megatron", "--hf-dir", str(d / "hf"), "--output", str(d / "ckpt"),
                                    "--no-progress-bar"]) for d, _ in made.values()]
    return {"models": {name: (d, model, p) for (name, (d, model)), p in zip(made.items(), procs)},
            "bad": list(zip(bad, results(failing, timeout=480)))}


@pytest.fixture(scope="module")
def converted(conversions):
    """name -> (HF model, HF dir, converted checkpoint dir)."""
    from megatron.training.checkpointing import check_checkpoint, iter_dir

    out = {}
    for name, (d, model, p) in conversions["models"].items():
        arch = CONFIGS[name][0]
        assert p.returncode == 0, p.stderr[-3000:]
        assert check_checkpoint(iter_dir(str(d / "ckpt"), 0), 0) is None  # sealed with a manifest
        flags = open(d / "ckpt" / "model_flags.txt").read().split()
        assert ("--use-rope-scaling" in flags) == (arch == "llama")
        out[name] = (model, str(d / "hf"), str(d / "ckpt"))
    return out


def _tokens():
    return np.random.RandomState(0).randint(0, VOCAB, size=DOCS[-1][1])


def test_logits_match_transformers(converted, from_converted):
    toks = _tokens()
    out, p = from_converted["logits"]
    assert p.returncode == 0, p.stderr[-3000:]
    for name, (model, _, _) in converted.items():
        ours = np.load(out / f"{name}.npy")
        with torch.no_grad():
            ref = torch.cat([model(torch.tensor(toks[a:b])[None]).logits[0] for a, b in DOCS]).double().numpy()
        whole = model(torch.tensor(toks)[None]).logits[0].detach().double().numpy()
        diff = np.abs(ours - ref).max()
        print(f"{name}: max abs logits diff {diff:.3g} (logits up to {np.abs(ref).max():.3g})")
        assert diff <= 1e-4, name
        assert np.abs(ours - whole).max() > 1e-2  # documents really are separate (no vacuous pass)


ROUND_TRIPS = {"qwen2-tied-sharded": 0.05, "llama-untied-sharded": None}  # name -> --max-shard-size-mb


@pytest.fixture(scope="module")
def converted_back(from_converted):
    """name -> (HF directory written by ``convert.py megatron-to-hf`` from its converted
    checkpoint, the result of that command)."""
    return from_converted["back"]


@pytest.mark.parametrize("name,shard_mb", ROUND_TRIPS.items())
def test_round_trip_bit_exact(converted, converted_back, name, shard_mb):
    from transformers import AutoModelForCausalLM

    model = converted[name][0]
    out, p = converted_back[name]
    assert p.returncode == 0, p.stderr[-3000:]
    assert os.path.isfile(out / ("model.safetensors.index.json" if shard_mb else "model.safetensors"))
    assert os.path.isfile(out / "generation_config.json")
    back = AutoModelForCausalLM.from_pretrained(str(out))
    assert json.load(open(out / "config.json"))["tie_word_embeddings"] == CONFIGS[name][1]
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _hf_loss(model, docs):
    """Mean next-token loss over the documents' own targets (no cross-document ones)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            logits = model(torch.tensor(d)[None]).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(d[1:]), reduction="sum").item()
            count += len(d) - 1
    return total / count


FINETUNES = [("qwen2-untied", 2, False, None, 1), ("qwen2-tied-sharded", 1, True, None, 1),
             ("llama-4-layers", 2, False, 2, 1), ("qwen2-untied", 1, False, None, 2)]
"""(checkpoint name, PP, tied, VPP, TP) of each ``--finetune`` launch."""


@pytest.fixture(scope="module")
def from_converted(converted, tmp_path_factory, world):
    """Every command that needs only the converted checkpoints, in the world: the logits
    worker on all four checkpoints (``"logits"``: its output directory, its result),
    ``convert.py megatron-to-hf`` of each of
    :data:`ROUND_TRIPS` (``"back"``: name -> (HF directory it wrote, its result)) and the
    one-step ``pretrain_gpt.py --load CKPT --finetune`` launch of each of
    :data:`FINETUNES`, on the same documents (``"finetune"``: case -> (the documents,
    its result))."""
    from megatron.training.indexed_io import write_documents

    toks = _tokens()
    docs = [toks[a:b] for a, b in DOCS]
    tmp = tmp_path_factory.mktemp("from-converted")
    np.save(tmp / "tokens.npy", toks)
    np.save(tmp / "cu.npy", np.array([0] + [b for _, b in DOCS]))
    prefix = str(tmp / "data")
    write_documents(prefix, docs, VOCAB)
    jobs = []
    for name, (_, _, ckpt) in converted.items():
        jobs += [ckpt, str(tmp / f"{name}.npy")]
    argvs, nprocs = [[WORKER, str(tmp / "tokens.npy"), str(tmp / "cu.npy"), *jobs]], [1]
    backs = {name: tmp_path_factory.mktemp("back-" + name) / "back" for name in ROUND_TRIPS}
    for name, mb in ROUND_TRIPS.items():
        argvs.append([CONVERT, "megatron-to-hf", "--load", converted[name][2], "--output", str(backs[name]),
                      "--no-progress-bar", *(["--max-shard-size-mb", str(mb)] if mb else [])])
        nprocs.append(1)
    for name, pp, tie, vpp, tp in FINETUNES:
        model, _, ckpt = converted[name]
        flags = open(os.path.join(ckpt, "model_flags.txt")).read().split()
        if tie:
            flags += ["--model-preset", "qwen2.5-0.5b"]
        seq, gbs = "128", "1"
        if vpp:  # the interleaved schedule needs micro-batches divisible by PP: two of 64 tokens
            flags += ["--num-layers-per-virtual-pipeline-stage", str(len(model.model.layers) // (pp * vpp))]
            seq, gbs = "64", "2"
        argvs.append([os.path.join(ROOT, "pretrain_gpt.py"), *flags, "--load", ckpt, "--finetune",
                      "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--split", "1,0,0",
                      "--seq-length", seq, "--global-batch-size", gbs, "--train-iters", "1", "--lr", "0",
                      "--no-progress-bar", "--pipeline-model-parallel-size", str(pp),
                      "--tensor-model-parallel-size", str(tp)])
        nprocs.append(pp * tp)
    procs = [world.launch(argv[0], argv[1:], nproc=n) for argv, n in zip(argvs, nprocs)]
    back = procs[1:1 + len(ROUND_TRIPS)]
    return {"logits": (tmp, procs[0]),
            "back": {name: (backs[name], p) for name, p in zip(ROUND_TRIPS, back)},
            "finetune": {case: (docs, p) for case, p in zip(FINETUNES, procs[1 + len(ROUND_TRIPS):])}}


@pytest.fixture(scope="module")
def finetuned(from_converted):
    """Case -> (the documents, the result of its one-step ``--finetune`` launch)."""
    return from_converted["finetune"]


@pytest.mark.parametrize("name,pp,tie,vpp,tp", FINETUNES)
def test_finetune_starts_from_converted(converted, finetuned, name, pp, tie, vpp, tp):
    """The driver's first step (dense attention) reproduces transformers' loss; ``tie``:
    trained with tied embeddings (a preset's tie, every shape flag overriding it);
    ``vpp``: interleaved virtual stages (4 layers over PP=2 x VPP=2, one layer a chunk);
    ``tp``: tensor parallel (megatron-core splits the converted tensors over the ranks)."""
    model = converted[name][0]
    docs, p = finetuned[(name, pp, tie, vpp, tp)]
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if "SUMMARY_JSON " in ln]
    assert len(line) == 1, p.stdout[-2000:]
    loss = json.loads(line[0].split("SUMMARY_JSON ", 1)[1])["losses"][0]
    ref = _hf_loss(model, docs)
    print(f"{name} TP={tp} PP={pp} VPP={vpp} tied={tie}: first-step loss {loss:.7f}, "
          f"transformers {ref:.7f}, diff {abs(loss - ref):.3g}")
    assert abs(loss - ref) <= 1e-4


BAD_INPUTS = [
    (dict(architectures=["MistralForCausalLM"]), "architecture 'MistralForCausalLM' is not supported"),
    (dict(drop=("model.layers.0.self_attn.k_proj.bias",)), "missing tensor model.layers.0.self_attn.k_proj.bias"),
    (dict(tensors_of={"num_key_value_heads": 2}), "k_proj.weight has shape [16, 16], config.json implies [8, 16]"),
]


@pytest.fixture(scope="module")
def bad_input_runs(conversions):
    """Case index -> (its directory, holding only ``hf/`` before the conversion; the result
    of ``convert.py hf-to-megatron`` on it)."""
    return conversions["bad"]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=[m for _, m in BAD_INPUTS])
def test_bad_input_one_line_exit_2(bad_input_runs, case):
    mention = BAD_INPUTS[case][1]
    tmp_path, p = bad_input_runs[case]
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith("convert.py: error: ") and mention in lines[0], lines[0]
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no temporary directory


def test_tied_pipeline_is_accepted_on_cpu():
    """Tied embeddings across pipeline stages train on CPU too (megatron-core's first sync
    of the two copies is made a no-op while the model is built: tests/training/test_families.py
    trains it and compares the losses with PP 1)."""
    from megatron.training.arguments import parse_args

    argv = ["--model-preset", "qwen2.5-0.5b", "--num-layers", "2", "--pipeline-model-parallel-size", "2", "--cpu",
            "--mock-data"]
    args = parse_args(argv, world_size=2)
    assert not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 2


def test_recipe_with_the_models_hf_tokenizer(converted, tmp_path, world):
    """The README recipe end to end: the tokenizer.json that travels with the converted
    checkpoint (``CKPT/hf/``) tokenizes JSONL with tools/preprocess_data.py, and the
    driver trains from the checkpoint with ``--tokenizer-type HuggingFaceTokenizer``
    on it; the first-step loss equals transformers' on the same token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron.training.indexed_io import open_dataset

    model, hf_dir, _ = converted["qwen2-untied"]
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in os.listdir(hf_dir):
        os.symlink(os.path.join(hf_dir, f), hf / f)
    words.save(str(hf / "tokenizer.json"))
    ckpt = str(tmp_path / "ckpt")
    p = world.launch(CONVERT, ["hf-to-megatron", "--hf-dir", str(hf), "--output", ckpt, "--no-progress-bar"])
    assert p.returncode == 0, p.stderr[-3000:]
    tok = os.path.join(ckpt, "hf", "tokenizer.json")
    assert os.path.isfile(tok)
    toks = _tokens()
    docs = [toks[a:b] for a, b in DOCS]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in d)}) + "\n")
    prefix = str(tmp_path / "data")
    p = world.launch(os.path.join(ROOT, "tools", "preprocess_data.py"),
                     ["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", prefix, "--json-key", "text",
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok])
    assert p.returncode == 0, p.stderr[-3000:]
    ds = open_dataset(prefix)
    assert [list(ds[i]) for i in range(len(ds))] == [list(d) for d in docs]
    flags = open(os.path.join(ckpt, "model_flags.txt")).read().split()
    p = world.launch(os.path.join(ROOT, "pretrain_gpt.py"),
                     [*flags, "--load", ckpt, "--finetune", "--data-path", prefix, "--tokenizer-type",
                      "HuggingFaceTokenizer", "--tokenizer-model", tok, "--split", "1,0,0", "--seq-length", "128",
                      "--global-batch-size", "1", "--train-iters", "1", "--lr", "0", "--no-progress-bar"])
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if "SUMMARY_JSON " in ln]
    loss = json.loads(line[0].split("SUMMARY_JSON ", 1)[1])["losses"][0]
    assert abs(loss - _hf_loss(model, docs)) <= 1e-4


def test_converted_checkpoint_holds_its_model_flags(converted):
    """``--use-checkpoint-args`` reads a converted checkpoint's model flags (``args`` in its
    ``common.pt``): those of ``model_flags.txt``, and the vocabulary as converted."""
    from megatron.training.arguments import build_parser
    from megatron.training.checkpoint_args import read_checkpoint_args

    for _, _, ckpt in converted.values():
        saved = read_checkpoint_args(ckpt)
        flags = build_parser().parse_args(open(os.path.join(ckpt, "model_flags.txt")).read().split())
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "swiglu", "normalization", "untie_embeddings_and_output_weights", "rotary_base"):
            assert saved[name] == getattr(flags, name), name
        assert saved["padded_vocab_size"] == VOCAB and "seq_length" not in saved


def test_export_refuses_a_model_the_hf_layout_cannot_express(tmp_path):
    """A checkpoint trained with --apply-layernorm-1p (or another option the Llama/Qwen2 HF
    layout lacks) is refused by megatron-to-hf in one line: its weights would load and mean
    another model (zero-centred norm weights)."""
    import importlib.util

    from megatron.training.arguments import UsageError
    from megatron.training.checkpointing import TRACKER, iter_dir

    spec = importlib.util.spec_from_file_location("convert_tool", CONVERT)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for flag, value in (("apply_layernorm_1p", True), ("apply_layernorm_1p", False)):
        root = tmp_path / str(value)
        os.makedirs(iter_dir(str(root), 3))
        (root / TRACKER).write_text("3\n")
        torch.save({"args": {"num_layers": 2, flag: value}}, os.path.join(iter_dir(str(root), 3), "common.pt"))
        if value:
            with pytest.raises(UsageError, match="trained with --apply-layernorm-1p, which the Llama/Qwen2"):
                tool._refuse_non_hf_model(str(root))
        else:
            tool._refuse_non_hf_model(str(root))
