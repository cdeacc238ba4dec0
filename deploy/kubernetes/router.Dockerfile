# The router's image for router.yaml: docker build -f deploy/kubernetes/router.Dockerfile -t vllm-router:0.1.17 .
# Behind a mirror, pass pip's settings: --build-arg PIP_INDEX_URL=... (PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST).
FROM python:3.11-slim
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
RUN pip install --no-cache-dir vllm-router==0.1.17
USER 65532
ENTRYPOINT ["vllm-router"]
