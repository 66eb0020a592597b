"""Telemetry shared by the three services: tracing (OpenTelemetry, configured by OTEL_*) and
structured logs."""
