"""Measurements of wbrag-ray's costly steps on the machine at hand: `python -m benchmarks [--quick]`.

Each benchmark prints one `name: value unit` line per figure and the ratios measured within the same run;
`python -m benchmarks.<name>` runs one alone. Shared mechanics live in `benchmarks.common`.
"""
