# The tokenizer image for an air-gapped cluster (the chart's `tokenizerSource.type: image` or
# `imageVolume`): each tokenizer directory at /tokenizers/<directory>, as `hf download` left it
# (docs/operations.md, "Air-gapped install"). The build context is the directory holding them, so
# the build itself needs no Hub:
#
#   buildah bud -f deploy/tokenizers.Dockerfile \
#     --build-arg GATEWAY_IMAGE=<registry>/llm-admission-gateway:<version> \
#     -t <registry>/llm-tokenizers:<tag> /mnt/tokenizers
#
# Built on the gateway's own image: the cluster's registry already holds it and its nodes its
# layers, so a pull costs the files' layer alone, and the init container that copies them finds
# `cp` in it (an image volume needs nothing from the base). No ConfigMap instead: a Gemma 3
# tokenizer.json is 33 MB, past a ConfigMap's 1 MiB. GATEWAY_IMAGE has no default: name the
# release the chart runs (its appVersion).
ARG GATEWAY_IMAGE

# The files readable by the pod's user (10001), without huggingface_hub's `.cache` bookkeeping
# (its files are the downloader's alone, mode 0600), in one layer of the final image.
FROM ${GATEWAY_IMAGE} AS files
USER root
COPY . /tokenizers/
RUN rm -rf /tokenizers/*/.cache && chmod -R a+rX /tokenizers

FROM ${GATEWAY_IMAGE}
COPY --from=files /tokenizers /tokenizers/
