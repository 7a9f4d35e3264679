"""OpenTelemetry (OTLP) ingest: trace receivers over gRPC and HTTP, and their shared path."""
