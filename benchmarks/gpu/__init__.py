"""A prepared GPU check, run by hand on a GPU machine and never in CI: `python benchmarks/gpu/check.py`."""
