"""Zero-RAG's embedding pruner (`EmbeddingHead`: a small MLP on the stored sentence vectors, predicting with
numpy) and `pruner_metrics` for either pruner: MSE beside the mean's, Spearman, and top-quantile overlap."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np

HEAD_FILE = "head.npz"


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class EmbeddingHead:
    """mastery ~ sigmoid(W2 relu(W1 x + b1) + b2) (or sigmoid(w x + b) with hidden = 0)."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.weights = {k: np.asarray(v, np.float32) for k, v in weights.items()}

    @classmethod
    def train(
        cls, vectors: np.ndarray, scores: np.ndarray, hidden: int = 128, epochs: int = 200,
        weight_decay: float = 1e-3, lr: float = 1e-2, seed: int = 0,
    ) -> tuple[EmbeddingHead, list[float]]:
        """Full-batch AdamW on MSE of sigmoid outputs, with early stopping on 15% of rows held out."""
        import torch

        torch.manual_seed(seed)
        x_all = torch.from_numpy(np.asarray(vectors, np.float32))
        y_all = torch.from_numpy(np.asarray(scores, np.float32))
        order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x_all)))
        n_stop = len(x_all) * 15 // 100 if len(x_all) >= 20 else 0
        x, y = x_all[order[n_stop:]], y_all[order[n_stop:]]
        x_stop, y_stop = x_all[order[:n_stop]], y_all[order[:n_stop]]
        dim = x.shape[1]
        layers = [torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)] if hidden else [
            torch.nn.Linear(dim, 1)]
        net = torch.nn.Sequential(*layers)
        with torch.no_grad():  # start at the mean score: the baseline the head must beat
            mean = float(y.mean().clamp(1e-3, 1 - 1e-3))
            net[-1].bias.fill_(float(np.log(mean / (1 - mean))))
        opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
        losses = []
        best, best_state = float("inf"), None
        for _ in range(epochs):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(torch.sigmoid(net(x).squeeze(-1)), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if n_stop:
                with torch.no_grad():
                    held = torch.nn.functional.mse_loss(torch.sigmoid(net(x_stop).squeeze(-1)), y_stop).item()
                if held < best:
                    best, best_state = held, copy.deepcopy(net.state_dict())
        if best_state is not None:
            net.load_state_dict(best_state)
        linear = [m for m in net if isinstance(m, torch.nn.Linear)]
        weights = {f"w{i}": m.weight.detach().numpy().T.copy() for i, m in enumerate(linear)}
        weights |= {f"b{i}": m.bias.detach().numpy().copy() for i, m in enumerate(linear)}
        return cls(weights), losses

    def predict(self, vectors: np.ndarray) -> np.ndarray:
        h = np.asarray(vectors, np.float32)
        n_layers = len(self.weights) // 2
        for i in range(n_layers):
            h = h @ self.weights[f"w{i}"] + self.weights[f"b{i}"]
            if i < n_layers - 1:
                np.maximum(h, 0, out=h)
        return _sigmoid(h[:, 0]).astype(np.float32)

    @property
    def dim(self) -> int:
        return self.weights["w0"].shape[0]

    def save(self, folder: str | Path, info: dict[str, Any]) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        np.savez(folder / HEAD_FILE, **self.weights)
        (folder / "pruner.json").write_text(json.dumps({"kind": "embedding", **info}, indent=2))

    @classmethod
    def load(cls, folder: str | Path) -> EmbeddingHead:
        path = Path(folder) / HEAD_FILE
        if not path.exists():
            raise FileNotFoundError(f"no embedding pruner at {folder} ({HEAD_FILE} missing); run `wbrag train-pruner RUN`")
        with np.load(path) as data:
            return cls(dict(data))


def top_quantile_overlap(measured: np.ndarray, predicted: np.ndarray, q: float) -> dict[str, float]:
    """Overlap of the predicted top-q fraction with the measured one (ties: all at the (1 - q) quantile)."""
    n = len(measured)
    k = max(1, int(np.ceil(q * n)))
    cut = np.quantile(measured, 1 - q)
    true = set(np.flatnonzero(measured >= cut).tolist())
    pred = set(np.argsort(-predicted, kind="stable")[:k].tolist())
    hit = len(true & pred)
    return {"q": q, "precision": round(hit / k, 4), "recall": round(hit / max(1, len(true)), 4),
            "random_precision": round(len(true) / n, 4)}


def pruner_metrics(measured: np.ndarray, predicted: np.ndarray, q: float) -> dict[str, Any]:
    from scipy.stats import spearmanr

    measured = np.asarray(measured, np.float64)
    predicted = np.asarray(predicted, np.float64)
    constant = np.isclose(measured.std(), 0) or np.isclose(predicted.std(), 0)
    return {
        "mse": round(float(np.mean((measured - predicted) ** 2)), 5),
        "mse_predict_mean": round(float(np.var(measured)), 5),
        "spearman": None if constant else round(float(spearmanr(measured, predicted).statistic), 4),
        "top_quantile": top_quantile_overlap(measured, predicted, q),
    }
