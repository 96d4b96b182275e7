"""Embedding as a stage: text in, a normalized float vector per row out."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray.config import EmbedderConfig
from wbrag_ray.formats import embeddings_table
from wbrag_ray.models.embedder import Embedder
from wbrag_ray.stages.base import Resources, Stage


class EmbedStage(Stage):
    """(id, text) -> (id, vector). The id column keeps its name (`id`, `pid`, `sid`) so that Ray's row-level
    checkpointing can follow it from the read to the write."""

    name = "embed"
    section = "embedder"

    def __init__(self, config: EmbedderConfig, id_column: str = "id"):
        self.config = config
        self.id_column = id_column
        self.input_columns = (id_column, "text")
        self.output_columns = (id_column, "vector")

    @property
    def resources(self) -> Resources:
        c = self.config
        return Resources(c.num_cpus, c.num_gpus, c.concurrency, batch_size=c.batch_size * 8, threads=c.threads)

    def setup(self) -> None:
        self.embedder = Embedder(self.config)
        self.embedder.setup()

    def process_batch(self, batch: pd.DataFrame) -> pa.Table:
        vecs = stored(self.embedder.encode_passages(batch["text"].tolist()), self.config)
        # Only id and vector travel on: the text is already in the passages/sentences shards.
        return embeddings_table(batch[self.id_column].to_numpy(np.int64), vecs, self.id_column)


def stored(vectors: np.ndarray, config: EmbedderConfig) -> np.ndarray:
    """Vectors in the dtype embedding shards store them in (`embedder.storage_dtype`)."""
    return vectors.astype(np.float16 if config.storage_dtype == "float16" else np.float32)
