"""Command line of ``pretrain_gpt.py``: Megatron-LM flag names for the common subset.

:func:`build_parser` has no side effects (tools such as ``tools/profile_latency.py``
reuse it to accept "the same flags as pretrain_gpt.py"); :func:`parse_args` adds
validation and turns every usage error into ONE line on stderr and exit code 2.
Checks needing the world size read ``WORLD_SIZE`` (set by torchrun; 1 otherwise).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable, NoReturn, Optional, Sequence

from megatron.training import arg_checks, comm_rules, families, pipeline_layout, yarn
from megatron.training.arg_checks import UsageError
from sparsebalance.batching.strategies import STRATEGIES
from sparsebalance.tuning.policies import DST_POLICIES as DST_POLICY_REGISTRY


class OneLineParser(argparse.ArgumentParser):
    """argparse without the usage dump: errors are one line, exit 2."""

    def error(self, message: str) -> NoReturn:
        usage_error(message, prog=self.prog)

    def parse_known_args(self, args=None, namespace=None):
        # --model-preset's values are this parse's defaults, so explicit flags override them;
        # the parser's own defaults are put back after, so a parser can be reused.
        from megatron.training.presets import MODEL_PRESETS, preset_in

        name = preset_in(sys.argv[1:] if args is None else list(args))
        if name not in MODEL_PRESETS or not any(a.dest == "model_preset" for a in self._actions):
            return super().parse_known_args(args, namespace)
        preset = MODEL_PRESETS[name]
        saved = dict(self._defaults), [(a, a.default) for a in self._actions if a.dest in preset]
        self.set_defaults(**preset)
        try:
            return super().parse_known_args(args, namespace)
        finally:
            self._defaults = saved[0]
            for action, default in saved[1]:
                action.default = default


class _DefaultsOnce(argparse.HelpFormatter):
    """``(default: X)`` after a flag's help unless the help already says its default (argparse's
    ArgumentDefaultsHelpFormatter printed it twice there) or there is none to say."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def usage_error(message: str, prog: str = "pretrain_gpt.py", code: int = 2) -> NoReturn:
    """Print ``prog: error: message`` on stderr and exit with ``code``."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _non_negative(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}")
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


CROSS_ENTROPY_FUSION_IMPLS = ("native", "te", "linear")
"""``--cross-entropy-fusion-impl`` names (Megatron-LM dev's ``ModelParallelConfig.cross_entropy_fusion_impl``)."""
BATCHING = tuple(STRATEGIES)
"""``--sb-batching`` names (sparsebalance.batching strategies)."""
DST_POLICIES = ("off", *DST_POLICY_REGISTRY)
"""``--sb-dst`` names."""
RECOMPUTE_GRANULARITY = ("full", "selective")
"""``--recompute-granularity`` names (megatron-core ``TransformerConfig.recompute_granularity``)."""
RECOMPUTE_METHODS = ("uniform", "block")
"""``--recompute-method`` names (megatron-core ``TransformerConfig.recompute_method``)."""


TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "NullTokenizer")
"""``--tokenizer-type`` names this driver reads (megatron/training/tokenizer.py)."""
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""``--lr-decay-style`` names (megatron-core ``OptimizerParamScheduler``)."""
TRANSFORMER_IMPLS = ("local", "transformer_engine", "inference_optimized")
"""``--transformer-impl`` names (Megatron-LM's)."""
ATTENTION_BACKENDS = ("auto", "local", "unfused", "flash", "fused")
"""``--attention-backend`` names (megatron-core ``AttnBackend``)."""


class _JoinWords(argparse.Action):
    """``--data-path A`` or ``--data-path 0.5 A 0.5 B``: store the words as one string."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not values:
            parser.error(f"{option_string}: expected a dataset prefix (or WEIGHT PREFIX pairs)")
        setattr(namespace, self.dest, " ".join(values))


def _model_flags(p: argparse.ArgumentParser) -> None:
    """The "model" flags."""
    pos, nonneg = _positive, _non_negative
    g = p.add_argument_group("model")
    from megatron.training.presets import MODEL_PRESETS

    g.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default=None,
                   help="architecture of a published model (Qwen2.5, Llama 3); explicit flags override it")
    g.add_argument("--num-layers", type=pos(int), default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=pos(int), default=128, help="model width")
    g.add_argument("--ffn-hidden-size", type=pos(int), default=None,
                   help="MLP width (default: 4 x hidden; with --swiglu int(8 x hidden / 3 / 64) x 64, as Megatron-LM)")
    g.add_argument("--num-attention-heads", type=pos(int), default=4, help="query heads")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups key/value heads (Megatron-LM's switch: "
                        "without it --num-query-groups is ignored)")
    g.add_argument("--num-query-groups", type=pos(int), default=None,
                   help="key/value heads with --group-query-attention (default: 1 with it; without it every "
                        "head has its own, as in Megatron-LM)")
    g.add_argument("--seq-length", type=int, default=1024,
                   help="tokens per micro-batch (packed documents, THD)")
    g.add_argument("--max-position-embeddings", type=pos(int), default=None,
                   help="longest position (default: --seq-length)")
    g.add_argument("--position-embedding-type", choices=("rope", "yarn", "learned_absolute", "none"),
                   default="learned_absolute",
                   help="learned_absolute (Megatron-LM's default), rope, yarn (RoPE with YaRN context extension, "
                        "megatron-core's YarnRotaryEmbedding), or none (no position signal besides the causal mask)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron-LM's older spelling of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="deprecated in Megatron-LM: no learned absolute embeddings, so it goes with "
                        "--position-embedding-type rope (which it leaves unchanged); otherwise an error, as there")
    g.add_argument("--rotary-percent", type=pos(float), default=1.0,
                   help="fraction of each head's dims that RoPE rotates (GPT-NeoX style partial rotary); "
                        "the rest carry content only")
    g.add_argument("--rotary-base", type=pos(int), default=10000, help="RoPE base (theta)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=pos(int), default=None,
                   help="RoPE position interpolation: positions are divided by this factor")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1 RoPE frequency scaling (low/high frequency factors 1/4, original context 8192)")
    g.add_argument("--rope-scaling-factor", type=pos(float), default=8.0, help="with --use-rope-scaling")
    # YaRN (megatron/training/yarn.py): Megatron-LM main's names and defaults; the three without the
    # yarn- prefix are declared with its multi-latent attention, which reads them too
    g.add_argument("--rotary-scaling-factor", type=pos(float), default=1.0,
                   help="YaRN: the context extension factor s (frequencies below the correction range are "
                        "divided by s)")
    g.add_argument("--yarn-original-max-position-embeddings", type=pos(int), default=None,
                   help="YaRN: the context the model was pretrained at (default 4096, as in Megatron-LM)")
    g.add_argument("--yarn-beta-fast", type=pos(float), default=None,
                   help="YaRN: rotations over the original context where interpolation stops (default 32)")
    g.add_argument("--yarn-beta-slow", type=pos(float), default=None,
                   help="YaRN: rotations over the original context where interpolation is full (default 1)")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN: the attention factor is m(s, mscale) / m(s, mscale-all-dim), m(s, x) = 0.1 x ln s + 1")
    g.add_argument("--mscale-all-dim", type=float, default=0.0, help="YaRN: see --mscale")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN: round the correction range's ends to whole dims (the default)")
    g.add_argument("--no-yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_false", default=None, help="YaRN: keep the correction range's ends fractional")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", type=pos(float), default=1e-5, help="LayerNorm/RMSNorm epsilon")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="bias on the query/key/value projection only (Qwen2), even with --disable-bias-linear")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output-layer weights (default: tied to the input embedding, as in "
                        "Megatron-LM; presets of untied models such as llama3-8b set it)")
    g.add_argument("--kv-channels", type=pos(int), default=None,
                   help="width of each attention head (default: hidden size / attention heads)")
    g.add_argument("--hidden-dropout", type=nonneg(float), default=0.1,
                   help="dropout of the embeddings and after attention and MLP (Megatron-LM's default)")
    g.add_argument("--attention-dropout", type=nonneg(float), default=0.1,
                   help="dropout of the dense attention probabilities (Megatron-LM's default; the sparse "
                        "attention kernels have none: with --sparse-attention pass 0)")
    g.add_argument("--init-method-std", type=pos(float), default=0.02,
                   help="std of the normal initialization of the weights")
    g.add_argument("--swiglu", action="store_true", help="gated SiLU MLP (Llama/Qwen style)")
    g.add_argument("--squared-relu", action="store_true", help="squared-ReLU MLP activation (not with --swiglu)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights centred on zero: each norm scales by 1 + weight (weights start at 0)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise each head's query and key (--normalization's kind) before attention")
    g.add_argument("--test-mode", action="store_true",
                   help="with --qk-layernorm: each attention forward checks that the q/k LayerNorm weights "
                        "and biases agree across DP and TP ranks (megatron-core's real-time test)")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="gate the attention output per channel with sigmoid(a projection of the input), "
                        "the gate projected with the QKV")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE rotates interleaved pairs of dims (GPT-J style) instead of the two halves")
    g.add_argument("--vocab-size", type=pos(int), default=None,
                   help="vocabulary size (default: from the tokenizer)")
    g.add_argument("--make-vocab-size-divisible-by", type=pos(int), default=128,
                   help="pad the vocabulary to a multiple of this x TP (presets of converted models set "
                        "1 to keep their vocabulary exact)")
    g.add_argument("--padded-vocab-size", type=pos(int), default=None,
                   help="embedding rows, as given (default: the vocabulary padded per "
                        "--make-vocab-size-divisible-by); at least the tokenizer's ids, a multiple of TP")
    g.add_argument("--no-pad-vocab-size", "--disable-pad-vocab-size", dest="pad_vocab_size", action="store_false",
                   help="keep the vocabulary's exact size (= --make-vocab-size-divisible-by 1; TP > 1 still "
                        "pads to a multiple of TP)")
    g.add_argument("--bf16", action="store_true", help="bf16 weights/activations (needs CUDA)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 weights/activations with dynamic loss scaling (needs CUDA)")
    g.add_argument("--loss-scale", type=pos(float), default=None,
                   help="with --fp16: a static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=pos(float), default=2.0 ** 32,
                   help="with --fp16: first dynamic loss scale")
    g.add_argument("--min-loss-scale", type=pos(float), default=1.0, help="with --fp16: smallest dynamic scale")
    g.add_argument("--loss-scale-window", type=pos(float), default=1000,
                   help="with --fp16: steps without overflow before the dynamic scale grows")
    g.add_argument("--hysteresis", type=pos(int), default=2,
                   help="with --fp16: overflows tolerated before the dynamic scale shrinks")
    g.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="transformer_engine",
                   help="transformer_engine (Megatron-LM's default): Transformer Engine's layer spec where CUDA "
                        "and transformer_engine are present and the attention is dense, else the local spec "
                        "with one warning line; local: megatron-core layers with this project's attention modules")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="dense attention: auto/local/unfused = this project's varlen attention; "
                        "flash/fused = Transformer Engine's (needs --transformer-impl transformer_engine)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="accepted without effect, as in Megatron-LM main (which reads it nowhere): the backend "
                        "is --attention-backend's")


def _sparse_attention_flags(p: argparse.ArgumentParser) -> None:
    """The "sparse attention" flags."""
    pos = _positive
    g = p.add_argument_group("sparse attention")
    g.add_argument("--sparse-attention", action="store_true",
                   help="block top-k sparse attention in the core_attention slot")
    g.add_argument("--sb-block-size", type=pos(int), default=64, help="key/query block, tokens")
    g.add_argument("--sb-topk", type=pos(int), default=8, help="key blocks kept per query block")
    g.add_argument("--sb-attention-backend", default="auto",
                   help="sparse kernel backend by name (auto picks the best available)")
    g.add_argument("--sb-dense-layers", type=pos(int), nargs="*", default=[],
                   help="1-based layer numbers kept dense")
    g.add_argument("--sb-routing", choices=("topk", "threshold"), default="topk",
                   help="topk: every query block keeps --sb-topk key blocks (besides sink and "
                        "diagonal); threshold: the fewest blocks holding --sb-threshold of each "
                        "head's gate softmax, within [--sb-topk-min, --sb-topk] (content-dependent "
                        "sparsity; DST then tunes the cap)")
    g.add_argument("--sb-threshold", type=float, default=None, metavar="TAU",
                   help="threshold routing's share of the gate softmax mass, 0 < TAU <= 1 "
                        "(default 0.9; needs --sb-routing threshold)")
    g.add_argument("--sb-threshold-counts", choices=("per-head", "per-block"), default=None,
                   help="threshold routing's count: per (query block, head) (default) or one per "
                        "query block, the largest head's, kept by every head (about twice the "
                        "pairs for the same coverage; for comparisons; needs --sb-routing threshold)")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    """The "parallelism" flags."""
    pos = _positive
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=pos(int), default=1)
    g.add_argument("--pipeline-model-parallel-size", type=pos(int), default=1)
    g.add_argument("--decoder-first-pipeline-num-layers", type=pos(int), default=None, metavar="N",
                   help="layers of the first pipeline stage (the others split the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=pos(int), default=None, metavar="N",
                   help="layers of the last pipeline stage (the others split the rest evenly)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the embedding counts as one layer when --num-layers is split over the stages")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the output layer and loss count as one layer when --num-layers is split")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help='layers of each stage, e.g. "Ettt|(tt|)*2,tL": E embedding, t transformer layer, '
                        'L loss, stages split by |, (..)*n repeats (Megatron-LM\'s grammar)')
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=pos(int), default=None,
                   help="enables the interleaved 1F1B schedule")
    g.add_argument("--context-parallel-size", type=pos(int), default=1,
                   help="CP ranks per micro-batch: each holds a head and a tail chunk of every "
                        "document; attention all-gathers keys/values per layer")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", dest="microbatch_group_size_per_vp_stage",
                   type=pos(int), default=None, metavar="N",
                   help="interleaved schedule: micro-batches run per virtual stage before the next (default: PP)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=pos(int), default=None,
                   help="virtual stages per pipeline rank (the other way to ask for the interleaved "
                        "schedule; layers per virtual stage = layers / PP / this)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron-LM's sequence parallelism; with TP = 1 it is off, as in Megatron-LM")
    g.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=None,
                   help="default: nccl with CUDA, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=pos(float), default=10.0,
                   help="a collective waiting longer than this fails (dead rank) instead of hanging")
    g.add_argument("--step-timeout-minutes", type=pos(float), default=None,
                   help="hung-rank watchdog: a rank whose training step, evaluation or checkpoint "
                        "save makes no progress for this long stops every rank (exit 1, one line "
                        "naming it) instead of waiting for --distributed-timeout-minutes. "
                        "Default: off")
    g.add_argument("--cpu", action="store_true", help="train on CPU even if CUDA is available")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible runs: the CPU path is already (same flags and seed, same losses and "
                        "weights); refused on CUDA, whose sparse-attention backward accumulates with atomics")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state (fp32 main params, Adam moments) over "
                        "data-parallel ranks (megatron-core's DistributedOptimizer)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each gradient bucket's all-reduce / reduce-scatter during backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: all-gather updated params during the "
                        "next forward (needs --overlap-grad-reduce)")


def _recompute_flags(p: argparse.ArgumentParser) -> None:
    """The "activation recomputation" flags."""
    pos = _positive
    g = p.add_argument_group("activation recomputation (Megatron-LM's flags)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="= --recompute-granularity selective (Megatron-LM's shorthand)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITY, default=None,
                   help="full: recompute whole transformer layers in backward (needs "
                        "--recompute-method and --recompute-num-layers); selective: recompute "
                        "only core attention (dense or sparse); default: store all activations")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="with full: uniform = checkpoint every group of --recompute-num-layers "
                        "layers of a model chunk; block = recompute only the first "
                        "--recompute-num-layers layers of each model chunk")
    g.add_argument("--recompute-num-layers", type=pos(int), default=None,
                   help="with full: layers per recompute group (uniform) or layers recomputed "
                        "per model chunk (block)")


def _loss_flags(p: argparse.ArgumentParser) -> None:
    """The "output layer and loss" flags (see megatron/training/loss_chunks.py)."""
    g = p.add_argument_group("output layer and loss (Megatron-LM's fusion flags)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fuse the loss as --cross-entropy-fusion-impl says (Megatron-LM's flag)")
    g.add_argument("--cross-entropy-fusion-impl", choices=CROSS_ENTROPY_FUSION_IMPLS, default="native",
                   help="with --cross-entropy-loss-fusion: linear = the output layer and the loss in chunks "
                        "of --sb-loss-chunk-tokens tokens, each chunk's logits recomputed in backward (the "
                        "logits are never whole; at TP=1 the loss fused in Triton passes; Megatron-LM's "
                        "dev-branch name); native / te: the same results as without fusion (no fused kernel here)")
    g.add_argument("--sb-loss-chunk-tokens", type=_positive(int), default=None, metavar="N",
                   help=f"tokens per chunk of --cross-entropy-fusion-impl linear (default "
                        f"{arg_checks.DEFAULT_LOSS_CHUNK_TOKENS}; under sequence parallelism, per TP rank)")


def _batching_flags(p: argparse.ArgumentParser) -> None:
    """The "batching" flags."""
    pos, nonneg = _positive, _non_negative
    g = p.add_argument_group("batching")
    g.add_argument("--micro-batch-size", type=pos(int), default=1,
                   help="packed sequences per micro-batch (THD packing requires 1)")
    g.add_argument("--global-batch-size", type=pos(int), default=None,
                   help="micro-batches x DP per step (default: micro-batch size x DP)")
    g.add_argument("--step-batch-size-schedule", default=None, metavar="'0:N T:M ...'",
                   help="Megatron-LM's batch-size schedule (thresholds in tokens, K/M/B/T suffixes): the run "
                        "trains its first batch; refused where the run would reach the next threshold")
    g.add_argument("--sb-batching", choices=BATCHING, default=None,
                   help="packing strategy (sparsebalance.batching): megatron = whole documents in "
                        "order; sab = sparsity-aware (needs a predictor). Default: megatron, or sab "
                        "with --sparse-balance")
    g.add_argument("--max-carry-steps", type=nonneg(int), default=2,
                   help="a document deferred by the packer waits at most this many steps")


def _sparsebalance_flags(p: argparse.ArgumentParser) -> None:
    """The "SparseBalance" flags."""
    nonneg = _non_negative
    g = p.add_argument_group("SparseBalance (SAB packing + DST budgets)")
    g.add_argument("--sparse-balance", action="store_true",
                   help="= --sparse-attention --sb-batching sab --sb-dst critical-path "
                        "(explicit --sb-batching / --sb-dst still win)")
    g.add_argument("--sb-dst", choices=DST_POLICIES, default=None,
                   help="dynamic sparsity tuning: per micro-batch, per stage top-k each step "
                        "(needs --sparse-attention and a predictor). Default: off, or "
                        "critical-path with --sparse-balance")
    g.add_argument("--sb-anchor", choices=("mean", "max", "min"), default="mean",
                   help="anchor policy: aggregate of predicted latencies that budgets aim at")
    g.add_argument("--sb-p", type=float, default=0.1,
                   help="anchor policy: budgets stay within [(1-p) k0, (1+p) k0], 0 < p < 1")
    g.add_argument("--sb-topk-min", type=nonneg(int), default=None,
                   help="smallest DST budget (default: --sb-topk // 2)")
    g.add_argument("--sb-topk-max", type=nonneg(int), default=None,
                   help="largest DST budget (default: 2 x --sb-topk)")
    g.add_argument("--sb-attn-slack", type=float, default=0.0,
                   help="critical-path policy: retained attention may drop to (1 - slack) x "
                        "the static plan's, 0 <= slack < 1")
    g.add_argument("--sb-dst-floor", choices=("stage", "total"), default="stage",
                   help="critical-path policy: each stage keeps its static plan's attention (default: "
                        "budget moves between a stage's micro-batches only, never off a stage slower in "
                        "every one) or only the step's total (budget may move between stages)")
    g.add_argument("--sb-dst-taus", default=None, metavar="TAUS",
                   help="--sb-routing threshold: DST's budget levels, a comma list of TAUs around "
                        "--sb-threshold, which is always one (default: its tail 1 - TAU scaled by 2, 1.5, "
                        "0.7, 0.5, 0.3: 0.8,0.85,0.9,0.93,0.95,0.97 at 0.9); --sb-topk stays the cap")
    g.add_argument("--sb-dst-tau-study", default=None, metavar="PATH",
                   help="--sb-routing threshold: sparsity study JSON of documents measured at several TAUs "
                        "(benchmarks/sparsity_study.py --real --taus ...) whose density-vs-TAU relation prices "
                        "DST's TAU levels (default: the relation measured on SmolLM2-135M, "
                        "sparsebalance/batching/tau_curve.py)")
    g.add_argument("--sb-dst-sensitivity", choices=("off", "estimate"), default="off",
                   help="DST: among plans of the policy's step time and kept pairs, move budget "
                        "to the micro-batches estimated to lose most per dropped pair (estimate: "
                        "from --sb-sensitivity-study); default off until measured on a real model")
    g.add_argument("--sb-sensitivity-study", default=None, metavar="PATH",
                   help="sensitivity study JSON (documents with source, length, loss_delta; "
                        "benchmarks/harness/sparsity_real.py) the sensitivity estimator starts from")
    g.add_argument("--sb-stage-sensitivity", default=None, metavar="FILE",
                   help="DST: stage profile JSON (benchmarks/stage_sensitivity.py); among plans of the "
                        "policy's step time and kept pairs, move budget from the stages whose layers "
                        "lose little per dropped pair to those that lose much; default none")
    g.add_argument("--sb-auto-layout", action="store_true",
                   help="split --num-layers over the pipeline stages so that their predicted times "
                        "(layers, embedding, output layer and loss; --sb-profile / --sb-cost-model) are "
                        "equal on the training data (tools/propose_layout.py prints the same split)")
    g.add_argument("--no-sb-plan-ahead", dest="sb_plan_ahead", action="store_false",
                   help="DST: plan each step in line before it runs instead of in the "
                        "background during the previous step (with the correction one step "
                        "newer)")
    g.add_argument("--sb-timeline", default=None, metavar="DIR",
                   help="write each logged step's predicted and measured timeline "
                        "(tools/timeline.py format) and a Gantt PNG of the last one")
    g.add_argument("--sb-profile", default=None, metavar="PATH",
                   help="latency profile JSON from tools/profile_latency.py (predictor of SAB/DST)")
    g.add_argument("--sb-cost-model", default=None, metavar="NAME",
                   help="named cost model instead of a profile, e.g. h100-analytic")
    g.add_argument("--sb-allow-stale-profile", action="store_true",
                   help="use a profile whose hardware/model fingerprint differs (warn only)")


def _optimization_flags(p: argparse.ArgumentParser) -> None:
    """The "optimization" flags."""
    pos, nonneg = _positive, _non_negative
    g = p.add_argument_group("optimization (Megatron-LM's flags and rules; see megatron/training/lr_schedule.py)")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=nonneg(float), default=3e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=nonneg(float), default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=pos(int), default=None,
                   help="iterations over which the LR decays (default: --train-iters)")
    g.add_argument("--lr-decay-samples", type=pos(int), default=None,
                   help="with --train-samples: samples over which the LR decays (default: --train-samples)")
    g.add_argument("--lr-warmup-iters", type=nonneg(int), default=0)
    g.add_argument("--lr-warmup-samples", type=nonneg(int), default=0, help="with --train-samples")
    g.add_argument("--lr-warmup-fraction", type=nonneg(float), default=None,
                   help="warmup as a fraction of the decay steps (instead of --lr-warmup-iters/samples)")
    g.add_argument("--lr-warmup-init", type=nonneg(float), default=0.0, help="LR at the start of warmup")
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                   default="exponential", help="with --lr-decay-style WSD: shape of the final decay")
    g.add_argument("--lr-wsd-decay-iters", type=pos(int), default=None,
                   help="with --lr-decay-style WSD: iterations of the final decay")
    g.add_argument("--lr-wsd-decay-samples", type=pos(int), default=None,
                   help="with --lr-decay-style WSD and --train-samples: samples of the final decay")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, use this command line's LR/WD schedule, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, use the checkpoint's LR/WD schedule (without either flag, a "
                        "resume whose schedule differs from the checkpoint's is an error)")
    g.add_argument("--decoupled-lr", type=nonneg(float), default=None,
                   help="peak LR of the input embedding and output layer (default: --lr)")
    g.add_argument("--decoupled-min-lr", type=nonneg(float), default=None,
                   help="with --decoupled-lr: minimum LR of the input embedding and output layer "
                        "(default: --min-lr)")
    g.add_argument("--weight-decay", type=nonneg(float), default=0.01)
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="weight decay on the --qk-layernorm weights too (other 1-D parameters and "
                        "biases get none)")
    g.add_argument("--start-weight-decay", type=nonneg(float), default=None,
                   help="with --weight-decay-incr-style linear/cosine (default: --weight-decay)")
    g.add_argument("--end-weight-decay", type=nonneg(float), default=None,
                   help="with --weight-decay-incr-style linear/cosine (default: --weight-decay)")
    g.add_argument("--weight-decay-incr-style", choices=("constant", "linear", "cosine"), default="constant")
    g.add_argument("--adam-beta1", type=nonneg(float), default=0.9)
    g.add_argument("--adam-beta2", type=nonneg(float), default=0.999)
    g.add_argument("--adam-eps", type=pos(float), default=1e-8)
    g.add_argument("--sgd-momentum", type=nonneg(float), default=0.9, help="with --optimizer sgd")
    g.add_argument("--clip-grad", type=nonneg(float), default=1.0, help="global grad-norm clip (0: off)")
    g.add_argument("--train-iters", type=pos(int), default=None, help="iterations to train (default 20)")
    g.add_argument("--train-samples", type=pos(int), default=None,
                   help="samples (packed sequences) to train: iterations = this / --global-batch-size")
    g.add_argument("--seed", type=nonneg(int), default=1234)
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=pos(int), default=None, metavar="N",
                   help="at the start and after every N-th iteration check that all data-parallel replicas "
                        "hold the same weights (hashes all-gathered; a difference stops the run)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="do not stop on a non-finite loss or grad norm (default: stop with one line "
                        "naming the iteration, before anything non-finite is saved)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True, help="the default (see --no-check-...)")
    g.add_argument("--rerun-mode", choices=["disabled", "validate_results"], default="disabled",
                   help="validate_results: re-run a step whose loss is non-finite (or an injected error) "
                        "from the same state on the same data before its optimizer step; a reproduced "
                        "result stops the run with one line, a transient one goes on with the re-run's "
                        "result (megatron/training/rerun.py)")
    g.add_argument("--error-injection-rate", type=nonneg(int), default=0, metavar="N",
                   help="with --rerun-mode validate_results, inject an error into about one step in N "
                        "per rank (0: never), to exercise the re-run")
    g.add_argument("--error-injection-type", choices=["correct_result", "transient_error", "persistent_error"],
                   default="transient_error", help="how an injected error's re-run compares (see --rerun-mode)")
    g.add_argument("--exit-duration-in-mins", type=pos(float), default=None,
                   help="stop (saving with --save) once training has run this long")
    g.add_argument("--exit-interval", type=pos(int), default=None,
                   help="stop (saving with --save) at the first iteration divisible by this")


def _data_flags(p: argparse.ArgumentParser) -> None:
    """The "data" flags."""
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", action=_JoinWords, default=None,
                   help="prefix of a .bin/.idx indexed dataset, or a blend: WEIGHT PREFIX WEIGHT PREFIX ... "
                        "(Megatron-LM's form; several prefixes without weights mix in proportion to size)")
    g.add_argument("--data-cache-path", default=None, metavar="DIR",
                   help="where --mock-data writes its dataset (default: a temporary directory removed "
                        "at exit); no other cache exists here")
    g.add_argument("--mock-data", action="store_true",
                   help="train on random tokens (one --seq-length document per sample) instead of --data-path")
    g.add_argument("--split", default=None,
                   help="train,valid,test weights over documents (default with --data-path: '969, 30, 1' and a "
                        "warning, as in Megatron-LM)")
    g.add_argument("--fim-data", action="store_true",
                   help="fill-in-the-middle: rearrange documents' segments as prefix/suffix/middle with "
                        "sentinel tokens, lengths kept (megatron/training/fim.py)")
    g.add_argument("--fim-rate", type=float, default=0.5, help="probability that a segment is rearranged")
    g.add_argument("--fim-spm-rate", type=float, default=0.5,
                   help="probability that a rearranged segment is suffix-prefix-middle (else prefix-suffix-middle)")
    for name, token in (("prefix", "<fim_prefix>"), ("middle", "<fim_middle>"), ("suffix", "<fim_suffix>"),
                        ("pad", "<fim_pad>"), ("eod", "<|endoftext|>")):
        g.add_argument(f"--fim-{name}-token", default=token,
                       help=f"the FIM {name} sentinel, one token of the tokenizer (default {token})")
    g.add_argument("--mask-prompt-loss", action="store_true",
                   help="train only on each document's tokens from its loss start on (read from "
                        "DATA_PATH_loss_start.npy, written by tools/preprocess_data.py "
                        "--loss-start-key): prompts are context, answers are targets")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="see megatron/training/tokenizer.py (default: GPT2BPETokenizer, Megatron-LM's pretrain_gpt.py "
                        "default, given its --vocab-file and --merge-file; without them ByteTokenizer, UTF-8 bytes "
                        "with no files, and one warning line)")
    g.add_argument("--tokenizer-model", default=None,
                   help="HuggingFaceTokenizer: tokenizer.json or a directory holding one; "
                        "SentencePieceTokenizer / GPTSentencePieceTokenizer / Llama2Tokenizer: tokenizer.model")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                   help="NullTokenizer: targets equal to this id carry no loss (-1: no pad token)")


def _logging_flags(p: argparse.ArgumentParser) -> None:
    """The "logging, evaluation, checkpoints" flags."""
    pos, nonneg = _positive, _non_negative
    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=pos(int), default=1)
    g.add_argument("--eval-interval", type=nonneg(int), default=0, help="0: no evaluation")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="iterations per evaluation (Megatron-LM's default; <= 0: no evaluation, as there)")
    g.add_argument("--eval-global-batch-size", type=pos(int), default=None,
                   help="samples (packed sequences) per evaluation iteration, a multiple of --micro-batch-size "
                        "x DP (default: --global-batch-size)")
    g.add_argument("--start-eval-at-iter", type=nonneg(int), default=None,
                   help="evaluate only from this iteration on (default: from the first --eval-interval)")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the parameters after each step (log line, tensorboard, summary)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the number of zeros in the gradients of each step (log line, tensorboard, summary)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation perplexity to tensorboard")
    g.add_argument("--wandb-project", default=None,
                   help="log the run's scalars to this Weights & Biases project (last rank; needs wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name (default: one W&B picks)")
    g.add_argument("--wandb-save-dir", default=None, help="W&B's local run files (default: SAVE/wandb)")
    g.add_argument("--wandb-entity", default=None, help="W&B team or user the run goes to (default: yours)")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--save-interval", type=nonneg(int), default=0, help="0: save only at the end")
    g.add_argument("--ckpt-format", choices=("torch", "torch_dist", "torch_dcp", "fsdp_dtensor"),
                   default="torch_dist", help="torch_dist (Megatron-LM's default) is written; --load reads it "
                                              "and Megatron-LM's legacy per-rank torch format")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="with --load: take the model flags the command line leaves out from the checkpoint "
                        "(a given one that differs is an error)")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="with --use-distributed-optimizer: save its state per parameter (gathered over DP), "
                        "so the checkpoint resumes under any DP, TP and PP (default: dp_reshardable, which "
                        "resumes under another DP size only; plain Adam's state is always per parameter)")
    g.add_argument("--distrib-optim-fully-reshardable-mem-efficient", action="store_true",
                   help="with --dist-ckpt-optim-fully-reshardable: gather onto DP rank 0 only, over gloo "
                        "(less memory, same checkpoint content)")
    g.add_argument("--no-save-optim", action="store_true",
                   help="save the model and data position only (no optimizer state or LR schedule)")
    g.add_argument("--no-load-optim", action="store_true",
                   help="resume without loading the optimizer state and LR schedule (both start fresh)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: no checkpoint there is an error instead of a fresh start")
    g.add_argument("--keep-last", type=pos(int), default=None, metavar="N",
                   help="after each save delete the checkpoints in --save older than the newest N "
                        "intact ones (default: keep all)")
    g.add_argument("--save-retain-interval", type=pos(int), default=None, metavar="N",
                   help="after each save delete the previous checkpoint unless its iteration is a multiple "
                        "of N (a multiple of --save-interval): keeps every N-th and the newest")
    g.add_argument("--continue-on-save-failure", action="store_true",
                   help="a save that fails (disk full, unwritable --save) warns and training goes on "
                        "(default: error, exit 1); the run's last save must still succeed")
    g.add_argument("--load", default=None,
                   help="resume from the newest checkpoint in this directory (none there: a warning and a "
                        "fresh start, as in Megatron-LM)")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: take only the model weights (any parallel layout); "
                        "iteration, optimizer and data order start fresh")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM/SIGUSR1 finish the step, save, exit 0")
    g.add_argument("--no-progress-bar", action="store_true", help="plain log lines only")
    g.add_argument("--profile", action="store_true",
                   help="profile the steps after iteration --profile-step-start up to --profile-step-end "
                        "(nsys: cudaProfilerStart/Stop; see --use-pytorch-profiler)")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: torch.profiler records the window; the log and --summary-json get "
                        "its attention / other kernel time, the trace goes to --tensorboard-dir")
    g.add_argument("--profile-step-start", type=nonneg(int), default=10)
    g.add_argument("--profile-step-end", type=pos(int), default=12)
    g.add_argument("--profile-ranks", type=nonneg(int), nargs="+", default=[0], metavar="RANK")
    g.add_argument("--record-shapes", action="store_true", help="with --use-pytorch-profiler: record shapes")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true", help="same as --record-shapes")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="with --use-pytorch-profiler: record Python call stacks")
    g.add_argument("--summary-json", default=None, metavar="PATH",
                   help="rank 0 writes the run's metrics here at the end (atomically)")


TRAINER_DESCRIPTION = ("GPT training on megatron-core with packed documents (Megatron-LM's flag names; "
                       "CPU/gloo or GPU/NCCL).")
"""``pretrain_gpt.py --help``'s description (the first line of its docstring)."""


def build_parser(prog: str = "pretrain_gpt.py", megatron_lm_flags: bool = False, description: Optional[str] = None,
                 own_flags: Optional[Callable[[argparse.ArgumentParser], None]] = None) -> argparse.ArgumentParser:
    """The flags of ``pretrain_gpt.py`` (no validation beyond types).

    ``megatron_lm_flags``: also register the rest of Megatron-LM's flags (``compat.py``), as
    ``pretrain_gpt.py`` does; off for tools that extend this parser with their own flags
    (a name of theirs may be a Megatron-LM flag, e.g. ``--warmup``). Such a tool passes its
    own ``description`` and ``own_flags(parser)``, which adds its flags first, so that
    ``--help`` shows them before the trainer's."""
    p = OneLineParser(
        prog=prog,
        usage="%(prog)s [options]",  # argparse's own lists all ~200 flags once more (150 lines)
        description=description or TRAINER_DESCRIPTION,
        allow_abbrev=False,  # a typo must never silently match another flag
        formatter_class=_DefaultsOnce,
    )
    if own_flags is not None:
        own_flags(p)
    _model_flags(p)
    _sparse_attention_flags(p)
    _parallel_flags(p)
    families.add_flags(p)
    _recompute_flags(p)
    _loss_flags(p)
    _batching_flags(p)
    _sparsebalance_flags(p)
    _optimization_flags(p)
    _data_flags(p)
    _logging_flags(p)
    if megatron_lm_flags:  # the rest of Megatron-LM's flags: one line each, never "unrecognized"
        from megatron.training.compat import add_megatron_lm_flags

        add_megatron_lm_flags(p)
    return p


def _split(text: str) -> tuple[float, float, float]:
    try:
        parts = [float(x) for x in text.replace("/", ",").split(",")]
    except ValueError:
        raise UsageError(f"--split: expected comma-separated numbers, got {text!r}")
    parts = (parts + [0.0, 0.0])[:3]
    if any(x < 0 for x in parts) or parts[0] <= 0:
        raise UsageError(f"--split: the train weight must be > 0 and none negative, got {text!r}")
    total = sum(parts)
    return tuple(x / total for x in parts)  # type: ignore[return-value]


LEGACY_SPLIT = "969, 30, 1"
"""Megatron-LM's ``--split`` when ``--data-path`` comes without one (with a warning there)."""


def derive_model_fields(args: argparse.Namespace) -> None:
    """What Megatron-LM derives from flags left out: for :func:`validate` and for tools that
    rebuild a run's model from its flags without validating a run. ``--num-query-groups``
    counts only with ``--group-query-attention`` (1 group by default then; else a group per
    head, megatron-core's None); the MLP is 4h, with ``--swiglu`` int(8h/3/64) x 64 (SwiGLU's
    two input projections keep about 4h's parameters); positions up to ``--seq-length``;
    ``--split`` its legacy default; the tokenizer as :func:`arg_checks.resolve_tokenizer_default`;
    under ``--position-embedding-type yarn`` the YaRN flags left out (:func:`yarn.fill_defaults`)."""
    if not args.group_query_attention:
        args.num_query_groups = None
    elif args.num_query_groups is None:
        args.num_query_groups = 1
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    yarn.fill_defaults(args)
    if args.split is None:
        args.split = LEGACY_SPLIT
    if getattr(args, "tokenizer_type", None) is None:
        args.compat_warnings = list(getattr(args, "compat_warnings", None) or [])
        arg_checks.resolve_tokenizer_default(args)


def validate(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Check cross-flag consistency and fill derived fields; raises :class:`UsageError`."""
    ws = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    split_given = args.split is not None
    args.compat_warnings = list(getattr(args, "compat_warnings", None) or [])
    families.validate(args, ws)
    arg_checks.validate_batch_schedule(args)
    arg_checks.validate_megatron_lm(args)
    arg_checks.validate_wandb(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if args.seq_length < 2:
        raise UsageError(f"--seq-length must be >= 2 (a token and its target), got {args.seq_length}")
    if ws % (tp * pp * cp):
        raise UsageError(f"world size {ws} is not divisible by TP x PP x CP = {tp} x {pp} x {cp}")
    args.world_size = ws
    args.data_parallel_size = dp = ws // (tp * pp * cp)
    if pp > args.num_layers:
        raise UsageError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers {args.num_layers}")
    arg_checks.validate_pipeline_layout(args)
    # Megatron-LM's split counts the embedding / loss as layers with these flags (validate_args)
    units = pipeline_layout.split_units(args)
    vstages = args.num_virtual_stages_per_pipeline_rank
    if vstages is not None:
        if pp < 2:
            raise UsageError("--num-virtual-stages-per-pipeline-rank needs --pipeline-model-parallel-size >= 2")
        if args.num_layers_per_virtual_pipeline_stage is not None:
            raise UsageError("give --num-layers-per-virtual-pipeline-stage or "
                             "--num-virtual-stages-per-pipeline-rank, not both")
        if (units // pp) % vstages:
            raise UsageError(f"layers per stage ({units // pp}) not divisible by "
                             f"--num-virtual-stages-per-pipeline-rank {vstages}")
    vpl = args.num_layers_per_virtual_pipeline_stage
    if vpl is not None:
        if pp < 2:
            raise UsageError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        if (units // pp) % vpl:
            raise UsageError(f"layers per stage ({units // pp}) not divisible by "
                             f"--num-layers-per-virtual-pipeline-stage {vpl}")
    args.virtual_pipeline_model_parallel_size = pipeline_layout.virtual_stages(args)
    if args.virtual_pipeline_model_parallel_size is not None:
        args.num_layers_per_virtual_pipeline_stage = units // pp // args.virtual_pipeline_model_parallel_size
        if cp > 1:
            # That schedule needs padded micro-batches of --seq-length (see data.py); the
            # CP split pads documents itself, so the two paddings would have to agree.
            raise UsageError("--context-parallel-size > 1 with the interleaved schedule "
                             "(--num-layers-per-virtual-pipeline-stage) is not supported")
    # A micro-batch is one packed THD sequence: --micro-batch-size N packs N x --seq-length
    # tokens into it (documents chunked at --seq-length; attention never crosses a document),
    # the tokens Megatron-LM's N sequences of --seq-length hold.
    args.micro_batch_tokens = args.micro_batch_size * args.seq_length
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                         f"micro-batch size x DP = {args.micro_batch_size} x {dp}")
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.eval_global_batch_size is None:
        # Megatron-LM's default is its args.global_batch_size, which under a batch schedule it
        # sets to micro-batch size x DP (the flag cannot be given with one)
        args.eval_global_batch_size = args.micro_batch_size * dp if args.batch_schedule else args.global_batch_size
    if args.eval_global_batch_size % (args.micro_batch_size * dp):  # Megatron-LM asserts the same
        raise UsageError(f"--eval-global-batch-size {args.eval_global_batch_size} is not divisible by "
                         f"micro-batch size x DP = {args.micro_batch_size} x {dp}")
    args.eval_num_microbatches = args.eval_global_batch_size // (args.micro_batch_size * dp)
    if args.virtual_pipeline_model_parallel_size:  # megatron-core's interleaved schedule's constraints
        from sparsebalance.pipeline.schedule import check_schedule

        for what, m in (("", args.num_microbatches), ("evaluation ", args.eval_num_microbatches)):
            try:
                check_schedule("interleaved", pp, m, args.virtual_pipeline_model_parallel_size,
                               args.microbatch_group_size_per_vp_stage)
            except ValueError as e:
                raise UsageError(f"the interleaved schedule with {m} {what}micro-batches per rank: {e} "
                                 "(--microbatch-group-size-per-virtual-pipeline-stage sets the group)") from None
    if args.hidden_size % args.num_attention_heads and args.kv_channels is None:
        raise UsageError(f"--hidden-size {args.hidden_size} not divisible by "
                         f"--num-attention-heads {args.num_attention_heads} (or give --kv-channels)")
    derive_model_fields(args)
    if args.num_query_groups is not None and args.num_attention_heads % args.num_query_groups:
        raise UsageError(f"--num-attention-heads {args.num_attention_heads} not divisible by "
                         f"--num-query-groups {args.num_query_groups}")
    if args.max_position_embeddings < args.seq_length:
        raise UsageError(f"--max-position-embeddings {args.max_position_embeddings} < --seq-length {args.seq_length}")
    if args.rotary_percent > 1.0:
        raise UsageError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    rotated = int(head_dim * args.rotary_percent)
    if args.position_embedding_type == "rope" and (rotated == 0 or rotated % 2):
        raise UsageError(f"--rotary-percent {args.rotary_percent} rotates {rotated} of {head_dim} "
                         f"head dims; RoPE needs an even number, at least 2")
    try:
        from megatron.training.compat import DEST_PREFIX

        args.compat_warnings += yarn.validate(args, getattr(args, DEST_PREFIX + "original_max_position_embeddings",
                                                            None))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    from megatron.training.lr_schedule import validate_schedule

    validate_schedule(args, UsageError)
    arg_checks.check_batch_schedule_run(args)
    bad = [n for n in args.sb_dense_layers if n > args.num_layers]
    if bad:
        raise UsageError(f"--sb-dense-layers {bad[0]} is beyond --num-layers {args.num_layers}")
    if args.data_path and not split_given:  # Megatron-LM's warning
        args.compat_warnings.append(f"--data-path without --split: using Megatron-LM's legacy default '{LEGACY_SPLIT}'")
    args.split_fractions = _split(args.split)
    arg_checks.validate_balance(args)
    arg_checks.validate_recompute(args)
    arg_checks.validate_loss_chunks(args)
    arg_checks.validate_distributed_optimizer(args)
    args.compat_warnings += comm_rules.validate(args, UsageError)
    from megatron.training.data_sources import resolve_data

    resolve_data(args, UsageError)
    if args.mask_prompt_loss:
        from megatron.training.indexed_io import loss_start_path

        if not os.path.isfile(loss_start_path(args.data_path)):
            raise UsageError(f"--mask-prompt-loss needs {loss_start_path(args.data_path)} "
                             "(write it with tools/preprocess_data.py --loss-start-key)")
    arg_checks.validate_tokenizer(args)
    if args.fim_data:
        _validate_fim(args)
    # Megatron-LM trains and saves nothing when these come without --save (benchmark
    # scripts pass them): the same here, with one warning line each
    for flag, given in (("--save-interval", args.save_interval), ("--no-save-optim", args.no_save_optim),
                        ("--save-retain-interval", args.save_retain_interval)):
        if given and not args.save:
            args.compat_warnings.append(f"{flag} without --save: no checkpoint is written (as in Megatron-LM)")
    if args.save and args.save_retain_interval and args.save_interval \
            and args.save_retain_interval % args.save_interval:
        raise UsageError(f"--save-retain-interval {args.save_retain_interval} is not a multiple of "
                         f"--save-interval {args.save_interval} (as Megatron-LM requires)")
    if args.keep_last and not args.save:
        raise UsageError("--keep-last needs --save")
    if args.continue_on_save_failure and not args.save:
        raise UsageError("--continue-on-save-failure needs --save")
    if args.exit_signal_handler and not args.save:
        raise UsageError("--exit-signal-handler needs --save (it saves a checkpoint before exiting)")
    if args.finetune and args.load is None:  # Megatron-LM loads nothing then
        args.compat_warnings.append("--finetune without --load: no checkpoint to take weights from, training "
                                    "starts from scratch (as in Megatron-LM)")
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise UsageError(f"--load: {args.load} is not a directory")
    # Megatron-LM ignores these without --load (recipes pass them for their resumes): training
    # starts from scratch, and a flag meant to stop a run without a checkpoint says so
    if args.exit_on_missing_checkpoint and args.load is None:
        args.compat_warnings.append("--exit-on-missing-checkpoint without --load: no checkpoint to look for, "
                                    "training starts from scratch (as in Megatron-LM)")
    if args.eval_interval and args.eval_iters <= 0:
        args.compat_warnings.append(f"--eval-iters {args.eval_iters}: no evaluation (as in Megatron-LM), "
                                    f"whatever --eval-interval says")
    arg_checks.validate_dropout(args)
    return args


def _validate_fim(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for ``--fim-data`` (rates given, no mock data) and sentinels the tokenizer has."""
    from megatron.training.fim import fim_config
    from megatron.training.tokenizer import args_tokenizer

    if args.mock_data:
        raise UsageError("--fim-data with --mock-data: fill-in-the-middle needs text (as in Megatron-LM)")
    for flag, value in (("--fim-rate", args.fim_rate), ("--fim-spm-rate", args.fim_spm_rate)):
        if not value:
            raise UsageError(f"--fim-data needs {flag} > 0 (as Megatron-LM asserts)")
    try:
        fim_config(args, args_tokenizer(args), args.compat_warnings.append)
    except ValueError as e:
        raise UsageError(f"--fim-data: {e}") from None


@functools.cache
def _pretrain_parser() -> argparse.ArgumentParser:
    """``pretrain_gpt.py``'s parser, built once per process: about 1,200 flags, so a build
    costs more than a parse, and parsing leaves a parser as it was."""
    return build_parser(megatron_lm_flags=True)


def _sparse_attention_dropout(argv, args: argparse.Namespace) -> None:
    """Sparse attention applies no attention dropout: where the line does not set
    ``--attention-dropout`` (Megatron-LM's default 0.1) it trains with 0 and says so once; a
    value the line (or its preset) sets stays, and validation refuses it above 0."""
    if not (args.sparse_attention or args.sparse_balance) or args.attention_dropout == 0:
        return
    words = sys.argv[1:] if argv is None else list(argv)
    # the flag itself (the parser takes no abbreviations); a --model-preset sets 0 already
    if not any(w == "--attention-dropout" or w.startswith("--attention-dropout=") for w in words):
        args.compat_warnings.append(f"--attention-dropout not given: 0 with sparse attention, whose kernels apply "
                                    f"no dropout (Megatron-LM's default would be {args.attention_dropout:g})")
        args.attention_dropout = 0.0


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse and validate; any usage error prints one line and exits with code 2."""
    parser = _pretrain_parser()
    args = parser.parse_args(argv)
    try:
        args.compat_warnings = []
        if args.use_checkpoint_args:
            from megatron.training.checkpoint_args import apply_checkpoint_args, explicit_dests

            try:
                apply_checkpoint_args(args, explicit_dests(parser, argv), args.compat_warnings.append)
            except ValueError as e:
                raise UsageError(str(e))
        _sparse_attention_dropout(argv, args)
        return validate(args, world_size)
    except UsageError as e:
        usage_error(str(e), prog=parser.prog)
