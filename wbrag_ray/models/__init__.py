"""Model wrappers: embedder, bundled models, hardware choice, pruner head and router."""

from wbrag_ray.models.embedder import Embedder

__all__ = ["Embedder"]
