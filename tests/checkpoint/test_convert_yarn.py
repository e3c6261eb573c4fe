"""tools/checkpoint/convert.py with YaRN RoPE scaling, against transformers on tiny random models.

* HF -> ours: a Llama with ``rope_parameters`` yarn (transformers 5's layout, the defaults) and a
  Qwen2 with a legacy ``rope_scaling`` yarn (betas, no truncation, an explicit ``attention_factor``)
  give our GPTModel's logits equal to transformers' within 1e-5 (fp32), on documents longer than
  ``original_max_position_embeddings``; transformers' plain RoPE on the same weights is far off.
* ours -> HF: the exported ``config.json`` holds the checkpoint's yarn (also when the source config
  given has none) and transformers' logits from it are the source model's.
* A yarn config megatron-core cannot build is one ``error:`` line, exit 2, nothing written.
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
from _hf_models import TINY, write_plain_hf  # noqa: E402

CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
WORKER = os.path.join(HERE, "_logits_worker.py")
VOCAB = 96
DOCS = [(0, 100), (100, 160)]  # both longer than the original contexts below (32 and 48)
MODELS = {  # name -> (arch, rope parameters, written as a legacy rope_scaling)
    "llama-yarn": ("llama", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32}, False),
    "qwen2-yarn-legacy": ("qwen2", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 2.5,
                                    "original_max_position_embeddings": 48, "beta_fast": 24.0, "beta_slow": 2.0,
                                    "attention_factor": 1.25, "truncate": False}, True),
}


def make_yarn_hf(out_dir, arch, rope, legacy, seed=0):
    """Save a random ``arch`` model with YaRN ``rope`` (``legacy``: config.json rewritten to
    transformers 4.x's ``rope_theta`` + ``rope_scaling``); returns it as transformers loads it
    back from ``out_dir`` (the reference: what a user of that directory gets)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    kind = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    # the extended context, as transformers expects it: the original one times the factor
    extended = int(rope["original_max_position_embeddings"] * rope["factor"])
    model = kind[1](kind[0](vocab_size=VOCAB, rope_parameters=dict(rope),
                            **dict(TINY, max_position_embeddings=extended)))
    with torch.no_grad():  # norms and biases away from their 1 / 0 init so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    if legacy:
        path = os.path.join(out_dir, "config.json")
        cfg = json.load(open(path))
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = dict(params, type=params.pop("rope_type"))
        json.dump(cfg, open(path, "w"), indent=2)
    return AutoModelForCausalLM.from_pretrained(out_dir).eval()


def hf_logits(model, toks):
    with torch.no_grad():
        return torch.cat([model(torch.tensor(toks[a:b])[None]).logits[0] for a, b in DOCS]).double().numpy()


def plain_rope(model):
    """The same weights under transformers' RoPE without scaling (the vacuous-pass guard)."""
    from transformers import AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(cfg))
    plain.load_state_dict(model.state_dict())
    return plain.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, world):
    """Every conversion of the module, in the world: hf-to-megatron of :data:`MODELS`, then the
    logits worker on both checkpoints and megatron-to-hf of each (with its own ``hf/``), plus the
    Qwen2 one exported with a source config that has no yarn (``"plain-source"``)."""
    tmp = tmp_path_factory.mktemp("yarn")
    made = {}
    for name, (arch, rope, legacy) in MODELS.items():
        made[name] = make_yarn_hf(str(tmp / name / "hf"), arch, rope, legacy)
    procs = {name: world.launch(CONVERT, ["hf-to-megatron", "--hf-dir", str(tmp / name / "hf"), "--output",
                                          str(tmp / name / "ckpt"), "--no-progress-bar"]) for name in MODELS}
    for name, p in procs.items():
        assert p.returncode == 0, p.stderr[-3000:]
    toks = np.random.RandomState(0).randint(0, VOCAB, size=DOCS[-1][1])
    np.save(tmp / "tokens.npy", toks)
    np.save(tmp / "cu.npy", np.array([0] + [b for _, b in DOCS]))
    jobs = [x for name in MODELS for x in (str(tmp / name / "ckpt"), str(tmp / f"{name}.npy"))]
    plain = tmp / "plain-source"
    os.makedirs(plain)
    cfg = json.load(open(tmp / "qwen2-yarn-legacy" / "hf" / "config.json"))
    cfg.pop("rope_scaling")
    json.dump(cfg, open(plain / "config.json", "w"))
    argvs = [[WORKER, str(tmp / "tokens.npy"), str(tmp / "cu.npy"), *jobs]]
    argvs += [[CONVERT, "megatron-to-hf", "--load", str(tmp / name / "ckpt"), "--output", str(tmp / name / "back"),
               "--no-progress-bar"] for name in MODELS]
    argvs.append([CONVERT, "megatron-to-hf", "--load", str(tmp / "qwen2-yarn-legacy" / "ckpt"), "--hf-config",
                  str(plain), "--output", str(tmp / "plain-back"), "--no-progress-bar"])
    for p in [world.launch(argv[0], argv[1:]) for argv in argvs]:
        assert p.returncode == 0, p.stderr[-3000:]
    return tmp, made, toks


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_beyond_the_original_context(runs, name):
    tmp, made, toks = runs
    flags = open(tmp / name / "ckpt" / "model_flags.txt").read().split()
    assert flags[flags.index("--position-embedding-type") + 1] == "yarn"
    ours = np.load(tmp / f"{name}.npy")
    ref = hf_logits(made[name], toks)
    diff = np.abs(ours - ref).max()
    print(f"{name}: max abs logits diff {diff:.3g} (logits up to {np.abs(ref).max():.3g})")
    assert diff <= 1e-5
    assert np.abs(ours - hf_logits(plain_rope(made[name]), toks)).max() > 1e-2  # the scaling matters here


@pytest.mark.parametrize("name", MODELS)
def test_export_writes_yarn_back(runs, name):
    from transformers import AutoModelForCausalLM

    from megatron.training.checkpoint_args import read_checkpoint_args

    tmp, made, toks = runs
    saved = read_checkpoint_args(str(tmp / name / "ckpt"))
    assert saved["position_embedding_type"] == "yarn"
    assert saved["rotary_scaling_factor"] == MODELS[name][1]["factor"]
    cfg = json.load(open(tmp / name / "back" / "config.json"))
    rope = cfg["rope_scaling"] if MODELS[name][2] else cfg["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == MODELS[name][1]["factor"]
    back = AutoModelForCausalLM.from_pretrained(str(tmp / name / "back")).eval()
    a, b = made[name].state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert np.abs(hf_logits(back, toks) - hf_logits(made[name], toks)).max() <= 1e-5


def test_export_with_a_source_config_without_yarn(runs):
    """A checkpoint trained with yarn exported with a plain-RoPE source config (e.g. a Qwen2.5
    extended here with YaRN): the checkpoint's yarn is written, as transformers 4.x's rope_scaling."""
    from transformers import AutoModelForCausalLM

    tmp, made, toks = runs
    cfg = json.load(open(tmp / "plain-back" / "config.json"))
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["truncate"] is False
    back = AutoModelForCausalLM.from_pretrained(str(tmp / "plain-back")).eval()
    assert np.abs(hf_logits(back, toks) - hf_logits(made["qwen2-yarn-legacy"], toks)).max() <= 1e-5


def test_unbuildable_yarn_is_one_line(tmp_path):
    write_plain_hf(str(tmp_path / "hf"), rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                        "original_max_position_embeddings": 16,
                                                        "partial_rotary_factor": 0.5})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, CONVERT, "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--output",
                        str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0] == ("convert.py: error: config.json: yarn with partial_rotary_factor 0.5 is not supported "
                        "(megatron-core's YaRN rotates every head dim)")
    assert sorted(os.listdir(tmp_path)) == ["hf"]
