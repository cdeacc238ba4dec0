# The router's image for router.yaml: docker build -f deploy/kubernetes/router.Dockerfile -t vllm-router:0.1.17 .
FROM python:3.11-slim
RUN pip install --no-cache-dir vllm-router==0.1.17
USER 65532
ENTRYPOINT ["vllm-router"]
