"""Convert Hugging Face Llama / Qwen2 checkpoints and llama.cpp GGUF Llamas to this driver's format and back.

    # HF directory (config.json + model.safetensors or a sharded index) -> our checkpoint
    .venv/bin/python tools/checkpoint/convert.py hf-to-megatron --hf-dir /models/Qwen2.5-0.5B \\
        --output ckpt/qwen0.5b
    # prints the pretrain_gpt.py model flags (also in ckpt/qwen0.5b/model_flags.txt); then
    .venv/bin/python pretrain_gpt.py $(cat ckpt/qwen0.5b/model_flags.txt) --load ckpt/qwen0.5b --finetune ...
    # a llama.cpp GGUF file (Llama; F32/F16/BF16 or quantized, dequantized to fp32) -> our checkpoint,
    # with hf/config.json, hf/tokenizer.json and hf/tokenizer_config.json rebuilt from its metadata
    .venv/bin/python tools/checkpoint/convert.py gguf-to-megatron \\
        --gguf runs/models/SmolLM2-135M-Instruct.Q4_1.gguf --output runs/models/smollm2-135m
    # our checkpoint (converted or trained, any TP/PP it was saved with) -> HF directory
    .venv/bin/python tools/checkpoint/convert.py megatron-to-hf --load runs/ft/ckpt \\
        --hf-config ckpt/qwen0.5b/hf --output exported/qwen0.5b-ft

The written checkpoint is megatron's torch_dist format as ``pretrain_gpt.py --save``
writes it (``iter_0000000/`` + tracker, model weights only), so ``--load DIR
--finetune`` starts from it under any parallel layout. ``DIR/hf/`` keeps the
source ``config.json`` and tokenizer files (``--tokenizer-type HuggingFaceTokenizer
--tokenizer-model DIR/hf/tokenizer.json``). Tensors are read one at a time
(``safe_open``); the model itself is held once in fp32. Output appears only when
complete (temp directory, then rename). Bad input: one ``error:`` line, exit 2.
A YaRN ``rope_scaling`` becomes ``--position-embedding-type yarn`` and its flags; the export
writes the YaRN the checkpoint was trained with into ``config.json`` (docs/usage.md's table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import types
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron.training.arguments import OneLineParser, UsageError, usage_error  # noqa: E402
from megatron.training.hf_checkpoint import ConversionError  # noqa: E402

PROG = "convert.py"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _read_config(path: str) -> dict:
    path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise UsageError(f"{path} does not exist")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{path}: not a JSON object")
    return cfg


class HFReader:
    """Tensors of an HF directory by name, one at a time (single file or sharded index)."""

    def __init__(self, hf_dir: str):
        index = os.path.join(hf_dir, WEIGHT_FILES[1])
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.where = {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise UsageError(f"{index}: not a safetensors index ({e})") from None
        elif os.path.isfile(os.path.join(hf_dir, WEIGHT_FILES[0])):
            self.where = None
            self._single = os.path.join(hf_dir, WEIGHT_FILES[0])
        else:
            raise UsageError(f"{hf_dir} has neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}")
        if self.where is None:
            self.where = {k: self._single for k in self._handle(self._single).keys()}

    @staticmethod
    def _handle(path: str):
        """A fresh ``safe_open`` handle. Not cached: a handle memory-maps its file, and the
        pages a read touches stay resident while it lives, so caching them would hold
        every shard (the whole model a second time) by the end of the conversion."""
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise UsageError(f"{path} (named in the index) does not exist")
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise UsageError(f"{path}: not a safetensors file ({str(e).splitlines()[0][:200]})") from None

    def check(self, shapes: dict) -> None:
        """Every expected tensor present with its shape; raises ConversionError."""
        for name, shape in shapes.items():
            if name not in self.where:
                raise ConversionError(f"missing tensor {name}")
            handle = self._handle(self.where[name])
            if name not in handle.keys():  # the index names it, its shard lacks it
                raise ConversionError(f"missing tensor {name}: the index puts it in {self.where[name]}, "
                                      "which does not hold it")
            got = tuple(handle.get_slice(name).get_shape())
            if got != tuple(shape):
                raise ConversionError(f"tensor {name} has shape {list(got)}, config.json implies {list(shape)}")

    def get(self, name: str):
        import torch

        return self._handle(self.where[name]).get_tensor(name).to(torch.float32)


def _model_args(flags):
    """The driver's Namespace for ``flags`` (TP=PP=1 on CPU), as validate() would fill it."""
    from megatron.training.arguments import build_parser

    args = build_parser(PROG).parse_args(flags + ["--cpu", "--seq-length", "2"])
    args.virtual_pipeline_model_parallel_size = None
    return args


def _build(args):
    """A world of one and the whole GPTModel (unwrapped) for ``args``, its weights left
    uninitialized (every one is overwritten; megatron's CPU initialization would hold a
    second full-size copy of the largest matrices while it runs)."""
    from megatron.training.initialize import initialize
    from megatron.training.model import build_gpt_chunks, transformer_config

    initialize(args)
    config = transformer_config(args, use_cpu=True)
    config.perform_initialization = False
    return build_gpt_chunks(args, config, args.vocab_size)[0]


def _fresh_tmp(output: str) -> str:
    if os.path.exists(output) and not (os.path.isdir(output) and not os.listdir(output)):
        raise UsageError(f"--output {output} exists and is not an empty directory")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise UsageError(f"--output: directory {parent} does not exist")
    tmp = f"{os.path.abspath(output)}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    return tmp


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=quiet, file=sys.stderr)


def write_converted(shape, flags, get, output: str, write_hf, quiet: bool) -> None:
    """Our checkpoint of the model ``flags`` build, from HF tensors ``get(name)``, into
    ``output`` (temp directory, then rename), with ``model_flags.txt`` and ``hf/``
    (``write_hf(dir)`` fills it)."""
    import torch
    from megatron.core import dist_checkpointing

    from megatron.training import hf_checkpoint as H
    from megatron.training.checkpoint_args import saved_args
    from megatron.training.checkpointing import TRACKER, _sync_strategy, iter_dir, seal_checkpoint
    from megatron.training.initialize import shutdown

    tmp = _fresh_tmp(output)
    try:
        args = _model_args(flags)
        model = _build(args)
        try:
            params = dict(model.state_dict(keep_vars=True))
            names = [n for n in params if not n.endswith("_extra_state")]
            with _progress(len(names), "hf -> megatron", quiet) as bar:
                done = set()
                for name, tensor in H.megatron_from_hf(shape, get):
                    if name not in params or params[name].shape != tensor.shape:
                        raise ConversionError(f"{name}: the model built from config.json has no such "
                                              f"tensor of shape {list(tensor.shape)}")
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    done.add(name)
                    bar.update()
            left = sorted(set(names) - done)
            if left:
                raise ConversionError(f"no HF tensor maps to {left[0]}")
            os.makedirs(iter_dir(tmp, 0))
            # the model flags, for --use-checkpoint-args (not --seq-length: 2 builds the model here)
            saved = {k: v for k, v in saved_args(args).items() if k != "seq_length"}
            saved["padded_vocab_size"] = shape.vocab
            dist_checkpointing.save({"model0": model.sharded_state_dict(), "args": saved}, iter_dir(tmp, 0),
                                    sharded_strategy=_sync_strategy())
            seal_checkpoint(iter_dir(tmp, 0), 0)  # --load verifies it like a trained one
        finally:
            shutdown()
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write("0\n")
        os.makedirs(os.path.join(tmp, "hf"))
        write_hf(os.path.join(tmp, "hf"))
        with open(os.path.join(tmp, "model_flags.txt"), "w") as f:
            f.write(" ".join(flags) + "\n")
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {output}; train with: pretrain_gpt.py {' '.join(flags)} --load {output} --finetune")


def _check_tokenizer_fits(tokens: int, shape) -> None:
    if tokens > shape.vocab:
        raise ConversionError(f"the tokenizer has {tokens} tokens but the model's vocab_size is {shape.vocab}")


def hf_to_megatron(a) -> None:
    from megatron.training import hf_checkpoint as H

    if not os.path.isdir(a.hf_dir):
        raise UsageError(f"--hf-dir {a.hf_dir} is not a directory")
    cfg = _read_config(a.hf_dir)
    shape = H.read_shape(cfg)
    flags = H.flags_from_hf_config(cfg)
    tok = os.path.join(a.hf_dir, "tokenizer.json")
    if os.path.isfile(tok):
        from megatron.training.tokenizer import HFJsonTokenizer

        _check_tokenizer_fits(HFJsonTokenizer(tok).vocab_size, shape)
    reader = HFReader(a.hf_dir)
    reader.check({k: v for k, v in H.hf_shapes(shape).items() if k in H.hf_names(shape)})

    def copy_hf_files(dst: str) -> None:
        for fname in os.listdir(a.hf_dir):  # config + tokenizer files, not weights
            src = os.path.join(a.hf_dir, fname)
            if os.path.isfile(src) and not fname.endswith(".safetensors") and fname != WEIGHT_FILES[1]:
                shutil.copy2(src, os.path.join(dst, fname))

    write_converted(shape, flags, reader.get, a.output, copy_hf_files, a.no_progress_bar)


def gguf_to_megatron(a) -> None:
    from megatron.training import hf_checkpoint as H
    from megatron.training.gguf_checkpoint import GGUFModel

    if not os.path.isfile(a.gguf):
        raise UsageError(f"--gguf {a.gguf} is not a file")
    src = GGUFModel(a.gguf)
    flags = H.flags_from_hf_config(src.config)
    tok = src.tokenizer()
    _check_tokenizer_fits(tok.get_vocab_size(), src.shape)

    def write_hf(dst: str) -> None:
        for fname, obj in (("config.json", src.config), ("tokenizer_config.json", src.tokenizer_config())):
            with open(os.path.join(dst, fname), "w") as f:
                json.dump(obj, f, indent=2)
        tok.save(os.path.join(dst, "tokenizer.json"))

    write_converted(src.shape, flags, src.get, a.output, write_hf, a.no_progress_bar)


def _write_shards(tensors, out_dir: str, max_bytes: int, total: int, quiet: bool) -> None:
    """Stream ``(name, tensor)`` into safetensors shards of at most ``max_bytes``
    (one tensor may exceed it alone); one file, or shards + index."""
    from safetensors.torch import save_file

    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            path = os.path.join(out_dir, f"part-{len(shards):05d}.safetensors")
            save_file(current, path, metadata={"format": "pt"})
            shards.append((path, list(current)))
            current, size = {}, 0

    with _progress(total, "megatron -> hf", quiet) as bar:
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_bytes:
                flush()
            current[name], size = t, size + nbytes
            bar.update()
    flush()
    if len(shards) == 1:
        os.replace(shards[0][0], os.path.join(out_dir, WEIGHT_FILES[0]))
        return
    total_size = 0
    for i, (path, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(path, os.path.join(out_dir, final))
        total_size += os.path.getsize(os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(out_dir, WEIGHT_FILES[1]), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)


NOT_IN_HF = ("squared_relu", "apply_layernorm_1p", "qk_layernorm", "attention_output_gate", "rotary_interleaved")
"""Model flags of a trained checkpoint that the Llama / Qwen2 HF layout cannot express."""


def _saved_model_flags(load: str) -> dict:
    """The model flags saved in the checkpoint under ``load`` ({}: none recorded)."""
    from megatron.training.checkpoint_args import read_checkpoint_args

    try:
        return read_checkpoint_args(load) or {}
    except ValueError:  # no saved flags (a legacy checkpoint): nothing to go by
        return {}


def _refuse_non_hf_model(load: str) -> None:
    """UsageError when the checkpoint's saved model flags use one of :data:`NOT_IN_HF`
    (the weights would load, e.g. zero-centred norm weights, and mean another model)."""
    saved = _saved_model_flags(load)
    bad = [name for name in NOT_IN_HF if saved.get(name)]
    if bad:
        raise UsageError(f"--load {load}: trained with --{bad[0].replace('_', '-')}, which the Llama/Qwen2 "
                         "HF layout cannot express")


def megatron_to_hf(a) -> None:
    import torch

    from megatron.training import hf_checkpoint as H
    from megatron.training.checkpointing import load_weights
    from megatron.training.initialize import shutdown

    hf_cfg = a.hf_config or os.path.join(a.load, "hf")
    cfg = _read_config(hf_cfg)
    shape = H.read_shape(cfg)
    flags = H.flags_from_hf_config(cfg)
    if not os.path.isdir(a.load):
        raise UsageError(f"--load {a.load} is not a directory")
    from megatron.training.checkpointing import TRACKER, read_tracker

    try:
        if read_tracker(a.load) is None:
            raise UsageError(f"--load: no checkpoint in {a.load} (missing {TRACKER})")
    except ValueError as e:
        raise UsageError(str(e)) from None
    _refuse_non_hf_model(a.load)
    name = a.dtype if a.dtype != "auto" else cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    if name not in DTYPES[1:]:
        raise UsageError(f"config.json dtype {name!r} is not one of {', '.join(DTYPES[1:])}; give --dtype")
    dtype = getattr(torch, name)
    tmp = _fresh_tmp(a.output)
    try:
        args = _model_args(flags)
        model = _build(args)
        try:
            try:
                load_weights(a.load, [types.SimpleNamespace(module=model)])
            except ValueError as e:
                raise UsageError(str(e)) from None
            sd = model.state_dict()
            tied = shape.tied and torch.equal(sd["embedding.word_embeddings.weight"], sd["output_layer.weight"])
            total = len(H.hf_names(dataclasses.replace(shape, tied=tied)))
            tensors = ((n, t.to(dtype).contiguous()) for n, t in H.hf_from_megatron(shape, sd.__getitem__, tied))
            _write_shards(tensors, tmp, int(a.max_shard_size_mb * 2**20), total, a.no_progress_bar)
        finally:
            shutdown()
        src_dir = hf_cfg if os.path.isdir(hf_cfg) else os.path.dirname(os.path.abspath(hf_cfg))
        for fname in os.listdir(src_dir):  # tokenizer and generation files travel along
            src = os.path.join(src_dir, fname)
            if os.path.isfile(src) and not fname.endswith(".safetensors") and fname not in (
                    "config.json", WEIGHT_FILES[1]):
                shutil.copy2(src, os.path.join(tmp, fname))
        # the positions the checkpoint was trained with (YaRN added or dropped by a fine-tune)
        out_cfg = H.hf_config_positions(dict(cfg, tie_word_embeddings=tied), _saved_model_flags(a.load))
        out_cfg["dtype" if "dtype" in cfg or "torch_dtype" not in cfg else "torch_dtype"] = name
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(out_cfg, f, indent=2)
        os.replace(tmp, a.output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {a.output} ({'tied' if tied else 'untied'} embeddings, {name})")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    h = sub.add_parser("hf-to-megatron", help="HF directory -> checkpoint for pretrain_gpt.py --load --finetune")
    h.add_argument("--hf-dir", required=True, help="config.json + model.safetensors (or a sharded index)")
    h.add_argument("--output", required=True, help="new checkpoint directory")
    h.add_argument("--no-progress-bar", action="store_true")
    g = sub.add_parser("gguf-to-megatron", help="llama.cpp GGUF (Llama) -> checkpoint, HF config and tokenizer")
    g.add_argument("--gguf", required=True, help="a .gguf file (F32/F16/BF16 or a quantized type, dequantized)")
    g.add_argument("--output", required=True, help="new checkpoint directory")
    g.add_argument("--no-progress-bar", action="store_true")
    m = sub.add_parser("megatron-to-hf", help="checkpoint -> HF directory (AutoModelForCausalLM.from_pretrained)")
    m.add_argument("--load", required=True, help="checkpoint directory (converted, or from pretrain_gpt.py --save)")
    m.add_argument("--hf-config", default=None,
                   help="the source model's config.json or its directory (default: LOAD/hf)")
    m.add_argument("--output", required=True, help="new HF directory")
    m.add_argument("--dtype", choices=DTYPES, default="auto", help="tensor dtype (auto: config.json's)")
    m.add_argument("--max-shard-size-mb", type=float, default=5000.0, help="safetensors shard size")
    m.add_argument("--no-progress-bar", action="store_true")
    return p


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    try:
        if a.command == "hf-to-megatron":
            hf_to_megatron(a)
        elif a.command == "gguf-to-megatron":
            gguf_to_megatron(a)
        else:
            if a.max_shard_size_mb <= 0:
                raise UsageError(f"--max-shard-size-mb must be > 0, got {a.max_shard_size_mb}")
            megatron_to_hf(a)
    except (UsageError, ConversionError) as e:
        usage_error(str(e), prog=PROG)


if __name__ == "__main__":
    main()
