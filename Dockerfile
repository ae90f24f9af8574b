# The gateway's image: slim, non-root, nothing to write but /tmp (the Deployment mounts the root
# filesystem read-only). Tokenizers are mounted at run time (deploy/base: a read-only volume at
# /models/gemma-3-tokenizer; the chart: an emptyDir its init container, this image with
# HF_HUB_OFFLINE=0, fills from the Hub or a mirror, or a PVC, or deploy/tokenizers.Dockerfile's
# image), never baked in: the image stays model-agnostic and small, and a new tokenizer is a
# values change, not a rebuild. The policy comes from a ConfigMap mount. The
# `kv-events` extra (pyzmq, msgspec: a few MB) is in, so a policy can turn `precise_prefix` on.
#
#   docker build -t llm-admission-gateway:0.1.0 .
#   docker run -p 8080:8080 -v $PWD/policies:/etc/llm-gateway:ro \
#     -v /path/to/tokenizer:/models/gemma-3-tokenizer:ro llm-admission-gateway:0.1.0 \
#     serve --policy /etc/llm-gateway/gemma3-tpu-v6e.yaml --host 0.0.0.0 --port 8080
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY loadtest loadtest
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir '.[kv-events]'

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
RUN groupadd --gid 10001 gateway && useradd --uid 10001 --gid 10001 --no-create-home \
      --home-dir /tmp --shell /usr/sbin/nologin gateway
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["llm-gateway"]
CMD ["serve", "--policy", "/etc/llm-gateway/policy.yaml", "--host", "0.0.0.0", "--port", "8080"]
