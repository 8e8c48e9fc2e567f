"""Logging now; Prometheus metrics and OpenTelemetry arrive with their issue.
The only package allowed to import prometheus-client / opentelemetry."""
