"""The gates' ablation (Table 4) from one scoring pass: scored examples regated under every setting of tau_s,
tau_delta, tau_doc and n_min, with no model call (document-gate figures over the scored examples only)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np

from wbrag_ray.config import ConfigError
from wbrag_ray.layout import plain_name
from wbrag_ray.run import RunFolder
from wbrag_ray.writeback.gates import document_gate, utility_gate


def gate_sweep(run: RunFolder, version: str, tau_s: list[float], tau_delta: list[float], tau_doc: list[float],
               n_min: list[int]) -> list[dict[str, Any]]:
    """One row per setting: selection rate, mean retained documents, fallback rate, retained ranks."""
    folder = run.layout.writeback_version(plain_name(version, "--sweep VERSION"))
    if not folder.scored.exists():
        raise ConfigError(f"write-back version {version!r} of {run.uri} has no scored examples; train it first "
                          "with `wbrag writeback RUN --train PATH`")
    scored = folder.scored.read_table(["s_nr", "s_rag", "docs", "doc_scores"]).to_pandas()
    retrieved = (scored["docs"] != "[]").to_numpy()
    doc_scores = [json.loads(s) if isinstance(s, str) else None for s in scored["doc_scores"]]
    rows = []
    for ts, td, tdoc, nmin in itertools.product(tau_s, tau_delta, tau_doc, n_min):
        selected = [i for i, (r, n) in enumerate(zip(scored["s_rag"], scored["s_nr"], strict=True))
                    if retrieved[i] and utility_gate(r, n, ts, td)]
        gated = [document_gate(doc_scores[i], scored["s_nr"].iat[i], tdoc, nmin)
                 for i in selected if doc_scores[i] is not None]
        ranks = [r for kept, _ in gated for r in kept]
        rows.append({
            "tau_s": ts, "tau_delta": td, "tau_doc": tdoc, "n_min": nmin,
            "examples": len(scored), "selected": len(selected),
            "selection_rate": round(len(selected) / len(scored), 4) if len(scored) else 0.0,
            "doc_scored": len(gated),
            "mean_retained_docs": round(float(np.mean([len(k) for k, _ in gated])), 4) if gated else None,
            "fallback_rate": round(float(np.mean([f for _, f in gated])), 4) if gated else None,
            "rank_distribution": {str(r + 1): ranks.count(r) for r in sorted(set(ranks))},
        })
    folder.sweep.write_json({"version": version, "rows": rows})
    return rows


def format_sweep(version: str, rows: list[dict[str, Any]]) -> str:
    head = f"{'tau_s':>7}{'tau_delta':>10}{'tau_doc':>9}{'n_min':>6}{'selected':>10}{'rate':>7}{'doc scored':>11}" \
           f"{'docs kept':>10}{'fallback':>9}"
    lines = [f"write-back {version}: the gates under each setting (one scoring pass, no model calls)", head]
    for r in rows:
        kept = "-" if r["mean_retained_docs"] is None else f"{r['mean_retained_docs']:.2f}"
        fallback = "-" if r["fallback_rate"] is None else f"{r['fallback_rate']:.2f}"
        lines.append(f"{r['tau_s']:>7g}{r['tau_delta']:>10g}{r['tau_doc']:>9g}{r['n_min']:>6}{r['selected']:>10}"
                     f"{r['selection_rate']:>7.2f}{r['doc_scored']:>11}{kept:>10}{fallback:>9}")
    return "\n".join(lines)
