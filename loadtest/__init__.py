"""Benchmarks and load tests: ``python -m loadtest.bench`` and its siblings, from a checkout."""
