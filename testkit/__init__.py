"""Helpers that both the test suite (tests/) and the benchmarks (bench/) use: the tiny random
model, Q4_1-shaped weights, a gateway process on a free port, the in-process fleet on virtual
clocks, the real PostgreSQL, Redis and Prometheus servers started on loopback, and the test tiers.

They live here, not in tests/, so that a benchmark never imports the test suite and runs on its
own (`python -m bench.<name>` from the repository root). This package may import any package
of ours; no product package (gateway, runtime, ...) may import it (tests/test_import_rules.py).
"""
