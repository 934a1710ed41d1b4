# The extproc service and the simulated worker: one image, the command picks the role
# (see docker-compose.yml). Core dependencies only; Envoy runs from its official image.
#
#   docker build -t envoy-llm-shedder .
#   docker run --rm envoy-llm-shedder python -m extproc --help
FROM python:3.11-slim-bookworm

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
