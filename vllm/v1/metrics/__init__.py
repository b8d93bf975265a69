"""Frontend metrics: per-request timings (stats.py) and their Prometheus export (loggers.py)."""
