"""Stages: one class (or shard task) per unit of work; see `base.Stage`."""
