"""Pipelines: compositions of stages, each readable top to bottom in its own file."""
