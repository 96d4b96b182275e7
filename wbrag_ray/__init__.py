"""wbrag-ray: knowledge-base training for RAG (Zero-RAG pruning, WriteBack-RAG enrichment) on Ray."""

__version__ = "0.1.0"

from wbrag_ray.config import WbragConfig, load_config  # noqa: E402
from wbrag_ray.metrics import score_answer  # noqa: E402

__all__ = ["WbragConfig", "load_config", "score_answer", "__version__"]
