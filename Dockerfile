# Worker / producer / Flower image: CUDA base, torch with CUDA, the project with the gpu extra.
# docker compose builds it as hsx:latest (HSX_IMAGE); `docker build -t hsx .` does the same by hand.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    HSX_SPOOL_DIR=/spool HSX_CACHE_DIR=/cache/hsx HF_HOME=/cache/hf TRITON_CACHE_DIR=/cache/triton
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# torch first (its CUDA build from PyPI), and the build tools causal-conv1d compiles with.
RUN pip install "torch>=2.4,<3" setuptools wheel packaging ninja
COPY . /app
# The gpu extra: flash-linear-attention + fla-core (Gated DeltaNet kernels), nvidia-ml-py (gpu_stats),
# causal-conv1d. causal-conv1d builds against the installed torch (no build isolation) and needs nvcc
# when no prebuilt wheel matches this torch/CUDA; this runtime image has no nvcc, so a failed build
# leaves it out: transformers then runs the short convolution in torch (correct, a little slower;
# docs/FACTS.md §2) and the worker logs it.
RUN pip install -e ".[sharegpt]" "flash-linear-attention>=0.4" "fla-core>=0.4" "nvidia-ml-py>=12" \
    && (pip install --no-build-isolation "causal-conv1d>=1.5" \
        || echo "causal-conv1d not installed (no prebuilt wheel for this torch/CUDA): the torch fallback is used")
RUN useradd -m hsx && mkdir -p /cache /spool && chown hsx /cache /spool
USER hsx
CMD ["python", "-m", "workers"]
