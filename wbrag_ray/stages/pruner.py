"""Zero-RAG's mastery prediction over the whole corpus, as stages: a pruner in every actor, one score per
sentence. The embedding pruner reads the stored sentence vectors (no text, no re-embedding); the LM pruner
reads the sentence text."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa

from wbrag_ray.index.files import vectors_of
from wbrag_ray.models.hardware import pick_device
from wbrag_ray.models.pruner import EmbeddingHead
from wbrag_ray.stages.base import Resources, Stage
from wbrag_ray.storage import resolve
from wbrag_ray.training.lm_pruner import LMPrunerPredictor


class EmbeddingPredictStage(Stage):
    """(sid, vector) -> (sid, mastery_pred) with the embedding head: a matmul per block of vectors, run as tasks
    fused with the Parquet read (the head is cheap, the read is the work)."""

    name = "predict-embedding"
    input_columns = ("sid", "vector")
    output_columns = ("sid", "mastery_pred")
    batch_format = "pyarrow"

    def __init__(self, head_weights: dict[str, np.ndarray], num_cpus: float = 1.0, batch_size: int = 8192):
        self.head_weights = head_weights  # a few hundred KB: travels with the stage to every actor
        self.num_cpus, self.batch_size = num_cpus, batch_size

    @property
    def resources(self) -> Resources:
        return Resources(num_cpus=self.num_cpus, batch_size=self.batch_size, actors=False)

    def setup(self) -> None:
        self.head = EmbeddingHead(self.head_weights)

    def process_batch(self, batch: pa.Table) -> pa.Table:
        vectors = vectors_of(batch)
        if vectors.shape[1] != self.head.dim:
            raise ValueError(f"the embedding pruner expects {self.head.dim}-dimensional vectors, the stored ones "
                             f"have {vectors.shape[1]}: retrain it with `wbrag train-pruner RUN --force`")
        return pa.table({"sid": batch["sid"], "mastery_pred": pa.array(self.head.predict(vectors))})


class LMPredictStage(Stage):
    """(sid, text) -> (sid, mastery_pred) with the LoRA LM regressor."""

    name = "predict-lm"
    section = "zerorag.lm_pruner"
    input_columns = ("sid", "text")
    output_columns = ("sid", "mastery_pred")

    def __init__(self, model_dir: str, config):
        self.model_dir, self.config = model_dir, config  # config: LMPrunerConfig

    @property
    def resources(self) -> Resources:
        c = self.config
        return Resources(c.num_cpus, c.num_gpus, c.concurrency, batch_size=c.predict_batch_size * 4, threads=c.threads)

    def setup(self) -> None:
        # the device Ray gave this actor: a GPU only when it asked for one
        self.predictor = LMPrunerPredictor(resolve(self.model_dir).local_dir(), batch_size=self.config.predict_batch_size,
                                           device=pick_device(self.config.num_gpus))
        self.predictor.setup()

    def process_batch(self, batch: pd.DataFrame) -> pd.DataFrame:
        scores = self.predictor.predict(batch["text"].tolist())
        return pd.DataFrame({"sid": batch["sid"].astype("int64"), "mastery_pred": scores.astype(np.float32)})
