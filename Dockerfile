# spyre-server image.
#   Build:  docker build -t spyre-server .
#   Run:    docker run --stop-timeout 30 -p 8000:8000 spyre-server
#   Config: mount a file over /etc/spyre-server/config.yaml, or set SPYRE_SERVER_<SECTION>__<KEY>.
# Build arguments:
#   BASE_IMAGE       the image to build on (default python:3.11-slim-bookworm); on a Spyre node,
#                    the Spyre runtime image. It needs python3 with the venv module.
#   TORCH            cpu (default): install the CPU build of torch 2.13.0 from TORCH_INDEX_URL.
#                    base: keep the torch that the base image's python3 already has (a Spyre
#                    runtime image's, which torch_sendnn was built for); the build fails if that
#                    torch does not satisfy pyproject.toml.
#   TORCH_INDEX_URL  an index with the CPU build of torch 2.13.0 (PyTorch's CPU wheel index, or a
#                    mirror of it). Empty (default): pip's own index settings below must offer
#                    it; a CUDA build stops the build with a message naming this argument.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST
#                    pip's own settings, for a mirror or an air-gapped index (default: pip's
#                    default index). Pass the host's: --build-arg PIP_INDEX_URL="$PIP_INDEX_URL".
# Every other package is pinned by docker/requirements.lock (scripts/lock-image.sh writes it).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- deps: a venv with torch and the locked dependencies; no project sources, so a code change
# ---- does not rebuild it.
FROM ${BASE_IMAGE} AS deps
# A base image's default user may not be root; this stage only builds, it never runs.
# hadolint ignore=DL3002
USER 0
ARG TORCH=cpu
ARG TORCH_INDEX_URL=
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY docker/requirements.lock docker/locked_requirements.py docker/cpu_torch.py /tmp/build/
# TORCH=base: the venv also sees the base python3's site-packages (after its own), through a .pth
# file; this works whether that python3 is the system's or a venv's.
RUN set -eu; \
    case "${TORCH}" in \
        cpu) ;; \
        base) base_site=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))') ;; \
        *) echo "TORCH must be cpu or base, not ${TORCH}" >&2; exit 1 ;; \
    esac; \
    python3 -m venv /opt/venv; \
    if [ "${TORCH}" = base ]; then \
        purelib=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))'); \
        echo "${base_site}" > "${purelib}/base-image-site-packages.pth"; \
        /opt/venv/bin/python /tmp/build/locked_requirements.py --skip-installed \
            /tmp/build/requirements.lock > /tmp/build/requirements.txt; \
    else \
        /opt/venv/bin/pip install --no-deps ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
            torch==2.13.0; \
        /opt/venv/bin/python /tmp/build/cpu_torch.py; \
        /opt/venv/bin/python /tmp/build/locked_requirements.py \
            /tmp/build/requirements.lock > /tmp/build/requirements.txt; \
    fi; \
    /opt/venv/bin/pip install --no-deps -r /tmp/build/requirements.txt; \
    rm -rf /tmp/build

# ---- model: the default model, converted once; rebuilt only when the dependencies or
# ---- spyre_server/model/store.py change (that file runs here on its own).
FROM deps AS model
COPY spyre_server/model/store.py /tmp/build/store.py
RUN /opt/venv/bin/python -c "import importlib.util as u, pathlib; \
spec = u.spec_from_file_location('store', '/tmp/build/store.py'); store = u.module_from_spec(spec); \
spec.loader.exec_module(store); \
store.prepare_default_model(pathlib.Path('/opt/spyre-server/models'), progress=print)" \
    && chgrp -R 0 /opt/spyre-server \
    && chmod -R g=u,o+rX /opt/spyre-server \
    && rm -rf /tmp/build

# ---- kernels: the cpu backend's native kernels (linear_kernel and attention_kernel native),
# ---- compiled here so that the image needs no compiler; rebuilt only when their source changes.
# ---- Only x86-64 has them (elsewhere the auto kernels are onednn and flash).
FROM ${BASE_IMAGE} AS kernels
# hadolint ignore=DL3002
USER 0
COPY spyre_server/model/cpu/kernels /tmp/build/kernels
# The compiler is whatever the base's package manager has (it builds one file; no pin, no
# cleanup: this stage is discarded).
# hadolint ignore=DL3008,DL3040,DL3041
RUN set -eu; \
    mkdir -p /opt/spyre-server/kernels; \
    if [ "$(uname -m)" = x86_64 ]; then \
        if command -v apt-get >/dev/null; then \
            apt-get update -qq; \
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++; \
        elif command -v dnf >/dev/null; then \
            dnf install -y gcc-c++; \
        elif command -v microdnf >/dev/null; then \
            microdnf install -y gcc-c++; \
        else \
            echo "the kernels stage needs apt-get, dnf or microdnf to install g++" >&2; exit 1; \
        fi; \
        python3 /tmp/build/kernels/library.py --into /opt/spyre-server/kernels; \
    fi; \
    chgrp -R 0 /opt/spyre-server && chmod -R g=u,o+rX /opt/spyre-server

# ---- the image: the base, the venv, the model, then the project itself (a small layer).
FROM ${BASE_IMAGE}
USER 0
ARG TORCH=cpu
# UID 1000 (group 0) runs the server; any other UID with group 0 can too (OpenShift). A base
# image that already has a UID 1000 user keeps it.
RUN if ! getent passwd 1000 >/dev/null; then \
        useradd --uid 1000 --gid 0 --no-create-home --home-dir /home/spyre spyre; \
    fi \
    && mkdir -p /home/spyre \
    && chown 1000:0 /home/spyre \
    && chmod 0775 /home/spyre
COPY --from=deps /opt/venv /opt/venv
COPY --from=model --chown=1000:0 /opt/spyre-server /opt/spyre-server
COPY --from=kernels --chown=1000:0 /opt/spyre-server/kernels /opt/spyre-server/kernels
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/spyre \
    SPYRE_SERVER_MODEL__CACHE_DIR=/opt/spyre-server/models \
    SPYRE_SERVER_MODEL__KERNEL_DIR=/opt/spyre-server/kernels \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md /tmp/src/
COPY kvcache /tmp/src/kvcache
COPY scheduler /tmp/src/scheduler
COPY spyre_server /tmp/src/spyre_server
COPY docker/check_install.py /tmp/check_install.py
RUN pip install --no-deps --no-build-isolation /tmp/src \
    && python /tmp/check_install.py --torch "${TORCH}" \
    && rm -rf /tmp/src /tmp/check_install.py
COPY config.yaml /etc/spyre-server/config.yaml
# The entrypoint sets up the Spyre card on the spyre backend (see the script), with the Spyre
# runtime's configuration file in the home folder, as the reference image has it.
COPY docker/entrypoint.sh /usr/local/bin/spyre-server-entrypoint
COPY --chown=1000:0 docker/.senlib.json /home/spyre/.senlib.json
USER 1000:0
WORKDIR /home/spyre
EXPOSE 8000
# Finds the port the server listens on (config file, flag or environment alike).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["/opt/venv/bin/python", "-m", "spyre_server.entrypoints.healthcheck"]
# spyre-server serve with these arguments (or another command named first: compile, ...).
ENTRYPOINT ["/usr/local/bin/spyre-server-entrypoint"]
CMD ["--config", "/etc/spyre-server/config.yaml"]
