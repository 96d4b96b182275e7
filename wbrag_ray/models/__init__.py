"""Model wrappers: the generator backends and the embedder, plus the bundled-model lookup."""

from wbrag_ray.models.embedder import Embedder
from wbrag_ray.models.generator import Generator, make_generator

__all__ = ["Embedder", "Generator", "make_generator"]
