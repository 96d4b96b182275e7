"""Model wrappers: the embedder, the bundled-model lookup, hardware choice, pruner head and router
(the generator backends live in `wbrag_ray.generation`)."""

from wbrag_ray.models.embedder import Embedder

__all__ = ["Embedder"]
