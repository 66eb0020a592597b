# tandem's CUDA image: one image for target, draft and router (compose.yaml picks the command).
# A runtime base suffices for tandem's torch path; flashinfer kernels that compile on first use
# need nvcc: build with --build-arg BASE=nvidia/cuda:12.8.1-devel-ubuntu22.04 for those.
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, exactly pinned: on Linux x86_64 pip's default index serves the CUDA build.
RUN pip install --upgrade pip && pip install torch==2.13.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY tandem ./tandem
COPY router ./router
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY protos ./protos
RUN pip install ".[gpu]"
# The shipped draft heads (compose's TANDEM_DRAFT_MODEL points into them).
COPY heads ./heads

# Model weights live in a volume (compose's `models` service fills it with `tandem models fetch`).
ENV TANDEM_HOME=/models
VOLUME ["/models"]
EXPOSE 50051 50052 50053 8000 9400 9401 9402
CMD ["tandem", "--help"]
