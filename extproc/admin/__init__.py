"""Admin HTTP API: /busy_threshold, /metrics, /health, /ready, /debug/workers."""
