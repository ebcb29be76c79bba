# Worker / producer image. CUDA base; the gpu extra brings the fast Gated DeltaNet kernels.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HSX_SPOOL_DIR=/spool TRITON_CACHE_DIR=/cache/triton
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY . /app
RUN pip install "torch>=2.4,<3" && pip install -e ".[gpu,sharegpt]"
RUN useradd -m hsx && mkdir -p /cache /spool && chown hsx /cache /spool
USER hsx
CMD ["python", "-m", "workers"]
