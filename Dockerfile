# SparseBalance GPU image.
#
# Base: NGC PyTorch 25.12 = PyTorch 2.10.0a0+b4e4ee81d3 built against CUDA 13.1.0,
# Python 3.12, Ubuntu 24.04, with Transformer Engine, NVIDIA apex, NCCL and cuDNN.
# torch and triton come from the container (its triton matches its torch) and are never
# reinstalled: the repo's requirements.txt pins the CPU wheel torch==2.13.0 for the venv,
# which must not land here. The container's /etc/pip/constraint.txt stays in force, so
# a pin below that disagrees with a package the container ships fails the build instead
# of silently replacing it.
#
#   docker build -t sparsebalance:latest .
#   docker build --build-arg TORCH_CUDA_ARCH_LIST="9.0" --build-arg MAX_JOBS=16 -t sparsebalance:h100 .
#   docker run --rm sparsebalance:latest                     # prints pretrain_gpt.py --help
#   docker run --rm --gpus all --ipc=host -v /data:/data sparsebalance:latest \
#       torchrun --nproc-per-node 8 pretrain_gpt.py --data-path /data/corpus ...
FROM nvcr.io/nvidia/pytorch:25.12-py3

# CUDA archs of the extension (A100 = 8.0, H100/H200/H20 = 9.0); MAX_JOBS bounds the
# parallel compile (each nvcc job can take several GB of RAM). The CPU kernels are
# compiled for a portable x86-64 level, not -march=native: the image runs on other
# machines than the one that built it (use "" on aarch64 / GH200 builds).
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
ARG MAX_JOBS=8
ARG SPARSEBALANCE_CPU_ARCH=x86-64-v3

ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    SPARSEBALANCE_CPU_ARCH=${SPARSEBALANCE_CPU_ARCH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

# The GPU stack the training path relies on must come with the base image: fail early,
# naming the missing piece, if another tag dropped one. Then the Python dependencies the
# base image does not provide (exact versions; see the note on constraints above).
RUN python -c "import importlib.util as u, sys; \
missing = [m for m in ('torch', 'triton', 'transformer_engine', 'apex') if u.find_spec(m) is None]; \
sys.exit('base image lacks: ' + ', '.join(missing) if missing else 0)" \
    && pip install --no-cache-dir \
        megatron-core==0.16.1 \
        tokenizers==0.23.3

# FlashAttention-4 (pure Python + CuTeDSL, JIT-compiled on first use; no CUDA build):
# --sb-attention-backend fa4 and the dense varlen baseline. The pins of requirements-gpu.txt.
RUN pip install --no-cache-dir \
        flash-attn-4==4.0.0b36 \
        "nvidia-cutlass-dsl[cu13]==4.8.1" \
        nvidia-cutlass-dsl-libs-core==4.8.1 \
        quack-kernels==0.6.5 \
        apache-tvm-ffi==0.1.15.post2 \
        torch-c-dlpack-ext==0.1.5 \
    && python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('flash_attn.cute') else 'flash-attn-4 not installed')"

WORKDIR /workspace/sparsebalance

# Extension sources first, so editing Python files does not rebuild the kernels.
COPY setup.py ./
COPY csrc/ csrc/
COPY sparsebalance/ sparsebalance/

# Builds sparsebalance._C (C++ CPU kernels) and sparsebalance._C_cuda (CUDA kernels for
# TORCH_CUDA_ARCH_LIST). No GPU is visible during `docker build`: setup.py decides from
# the CUDA toolkit (CUDA_HOME) and torch.version.cuda, not torch.cuda.is_available().
# The CUDA module is only located (not imported): importing it needs a driver.
RUN python setup.py -q build_ext --inplace \
    && python -c "import sparsebalance._C" \
    && python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('sparsebalance._C_cuda') else 'CUDA extension not built')" \
    && rm -rf build

COPY megatron/ megatron/
COPY tools/ tools/
# the experiment harness (make gpu-check runs benchmarks/gpu_check.sh inside the image)
COPY benchmarks/ benchmarks/
COPY examples/ examples/
# sample document lengths: the demo, the profile and the simulator read them by default
COPY data/lengths/ data/lengths/
COPY pretrain_gpt.py ./

# `megatron/` here is a namespace package (no __init__.py) that merges with
# megatron-core's `megatron.core`; the repo root on the path makes that work anywhere.
ENV PYTHONPATH=/workspace/sparsebalance

CMD ["python", "pretrain_gpt.py", "--help"]
