"""The HTTP layer: OpenAI-compatible endpoints, Prometheus metrics, errors, auth (DESIGN §6)."""
