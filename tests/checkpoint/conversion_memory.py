#!/usr/bin/env python
"""Peak memory of tools/checkpoint/convert.py on a Qwen2.5-0.5B-shaped model (measurement,
not a test: it writes ~4.5 GB and takes about a minute).

Real Qwen2.5-0.5B dimensions (24 layers, hidden 896, GQA 14/2, vocab 151936, tied),
random fp32 weights written locally in ~520 MB safetensors shards (no download); then
each direction runs in its own process and its peak RSS (``ru_maxrss`` of the child) is
compared with the size of the HF weight files; the exported tensors are compared
with the originals bit for bit. Prints one JSON object::

    .venv/bin/python tests/checkpoint/conversion_memory.py --workdir /tmp/conv05
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
CONVERT = os.path.join(ROOT, "tools", "checkpoint", "convert.py")
QWEN05 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
          "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "tie_word_embeddings": True, "hidden_act": "silu", "max_position_embeddings": 32768,
          "torch_dtype": "float32"}


def write_model(out: str, shard_bytes: int = 520 * 2**20) -> int:
    """Random QWEN05 weights as sharded safetensors + index; returns their bytes."""
    import torch
    from safetensors.torch import save_file

    from megatron.training import hf_checkpoint as H

    shape = H.read_shape(QWEN05)
    shapes = H.hf_shapes(shape)
    gen = torch.Generator().manual_seed(0)
    os.makedirs(out)
    shards, current, size = [], {}, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(current, os.path.join(out, name))
        shards.append((name, list(current)))

    for n in (n for n in shapes if n in H.hf_names(shape)):
        t = torch.randn(shapes[n], generator=gen) * 0.02
        if current and size + t.numel() * 4 > shard_bytes:
            flush()
            current, size = {}, 0
        current[n], size = t, size + t.numel() * 4
    flush()
    weight_map = {n: f for f, names in shards for n in names}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(QWEN05, f)
    return sum(os.path.getsize(os.path.join(out, f)) for f, _ in shards)


def same_tensors(a: str, b: str) -> bool:
    """Every tensor of HF directory ``a`` equals ``b``'s bit for bit (one at a time)."""
    import torch
    from safetensors import safe_open

    def where(d):
        idx = os.path.join(d, "model.safetensors.index.json")
        if os.path.isfile(idx):
            return {n: os.path.join(d, f) for n, f in json.load(open(idx))["weight_map"].items()}
        with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as h:
            return {n: os.path.join(d, "model.safetensors") for n in h.keys()}

    wa, wb = where(a), where(b)
    if set(wa) != set(wb):
        return False
    for n in wa:
        with safe_open(wa[n], framework="pt") as ha, safe_open(wb[n], framework="pt") as hb:
            x, y = ha.get_tensor(n), hb.get_tensor(n)
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return True


def peak_of(argv) -> tuple:
    """(peak RSS in bytes, seconds) of one convert.py process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run([sys.executable, CONVERT, *argv, "--no-progress-bar"], check=True, stdout=subprocess.DEVNULL)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:  # ru_maxrss of children is a running max: a smaller child is invisible
        raise SystemExit("error: run this script fresh (a larger child ran before)")
    return peak * 1024, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="scratch directory (created; removed at the end)")
    a = p.parse_args()
    if os.path.exists(a.workdir):
        raise SystemExit(f"error: --workdir {a.workdir} exists")
    try:
        hf_bytes = write_model(os.path.join(a.workdir, "hf"))
        ckpt, out = os.path.join(a.workdir, "ckpt"), os.path.join(a.workdir, "out")
        imp, imp_s = peak_of(["hf-to-megatron", "--hf-dir", os.path.join(a.workdir, "hf"), "--output", ckpt])
        exp, exp_s = peak_of(["megatron-to-hf", "--load", ckpt, "--output", out])
        exact = same_tensors(os.path.join(a.workdir, "hf"), out)
    finally:
        shutil.rmtree(a.workdir, ignore_errors=True)
    gb = 1e9
    print(json.dumps({"model": "qwen2.5-0.5b shape, random fp32", "hf_files_gb": round(hf_bytes / gb, 3),
                      "hf_to_megatron": {"peak_rss_gb": round(imp / gb, 3), "x_hf_files": round(imp / hf_bytes, 2),
                                         "seconds": round(imp_s, 1)},
                      "megatron_to_hf": {"peak_rss_gb": round(exp / gb, 3), "x_hf_files": round(exp / hf_bytes, 2),
                                         "seconds": round(exp_s, 1)},
                      "round_trip_bit_exact": exact}, indent=1))


if __name__ == "__main__":
    main()
