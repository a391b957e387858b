"""The benchmarks, a package run from the repository root: `python -m bench.<name> [--help]`.

Run as modules of this package, a benchmark named like one of ours (bench/kernels.py,
bench/loadtest.py, bench/gateway.py) cannot shadow that package, so no script edits sys.path;
what a benchmark shares with the tests (the tiny model, a gateway on a free port, the in-process
fleet, PostgreSQL and Redis) comes from testkit/, never from tests/.
"""
