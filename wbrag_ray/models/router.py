"""Zero-RAG's query router: a logistic regression on query embeddings predicting whether the generator answers
correctly without retrieval; saved as .npz, scored with numpy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

ROUTER_FILE = "router.npz"


class QueryRouter:
    def __init__(self, coef: np.ndarray, intercept: float, threshold: float):
        self.coef = np.asarray(coef, np.float32)
        self.intercept = float(intercept)
        self.threshold = float(threshold)

    @classmethod
    def train(cls, vectors: np.ndarray, labels: np.ndarray, threshold: float, seed: int = 0) -> QueryRouter:
        from sklearn.linear_model import LogisticRegression

        labels = np.asarray(labels, bool)
        if labels.all() or not labels.any():
            # One class only: the router can only repeat it. Logistic regression refuses; the prior is the answer.
            p = float(labels.mean())
            logit = np.log(max(p, 1e-6) / max(1 - p, 1e-6))
            return cls(np.zeros(vectors.shape[1], np.float32), logit, threshold)
        model = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000, random_state=seed)
        model.fit(vectors, labels)
        return cls(model.coef_[0], model.intercept_[0], threshold)

    def probability(self, vectors: np.ndarray) -> np.ndarray:
        return (1.0 / (1.0 + np.exp(-(np.asarray(vectors, np.float32) @ self.coef + self.intercept)))).astype(np.float32)

    def mastered(self, vectors: np.ndarray) -> np.ndarray:
        """True where the query should skip retrieval."""
        return self.probability(vectors) >= self.threshold

    def save(self, folder: str | Path, info: dict[str, Any]) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / ROUTER_FILE, coef=self.coef, intercept=np.float32(self.intercept),
                 threshold=np.float32(self.threshold))
        (folder / "router.json").write_text(json.dumps(info, indent=2))

    @classmethod
    def load(cls, folder: str | Path) -> QueryRouter:
        path = Path(folder) / ROUTER_FILE
        if not path.exists():
            raise FileNotFoundError(f"no query router at {folder} ({ROUTER_FILE} missing); train one with "
                                    "`wbrag train-router RUN --train PATH`")
        with np.load(path) as d:
            return cls(d["coef"], float(d["intercept"]), float(d["threshold"]))
