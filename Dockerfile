# phasewatch: the exporter, the simulator and the Dash dashboard in one image.
#   docker build -t phasewatch:0.1.0 .
#   docker run --rm -p 9464:9464 phasewatch:0.1.0 serve --model Llama-3.1-8B --hardware H100-SXM
# The entrypoint is the `phasewatch` command; the Kubernetes manifests pass `serve`
# or `dashboard ...` as args. Runs as a non-root user and needs no writable root
# filesystem (mount a tmpfs at /tmp).

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY exporter ./exporter
COPY dashboard ./dashboard
RUN python -m venv /opt/phasewatch \
    && /opt/phasewatch/bin/pip install --no-cache-dir . \
    && /opt/phasewatch/bin/phasewatch --help > /dev/null

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="phasewatch" \
      org.opencontainers.image.description="LLM serving split into queue, prefill and decode, against the hardware roofline" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/phasewatch /opt/phasewatch
ENV PATH=/opt/phasewatch/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# 4317 OTLP/gRPC, 4318 OTLP/HTTP, 50051 phasewatch gRPC, 9464 /metrics and the JSON
# API, 8050 the dashboard, 8001 `phasewatch tap` (the same image, args ["tap", ...]).
# Ingest binds 127.0.0.1 unless PHASEWATCH_*_HOST says otherwise.
EXPOSE 4317 4318 50051 9464 8050 8001
USER 65532:65532
ENTRYPOINT ["phasewatch"]
CMD ["serve"]
