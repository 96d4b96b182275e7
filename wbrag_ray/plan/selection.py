"""Write-back's figures of a config's own data, measured by `wbrag plan --calibrate` in one worker with the
generator's resources: the utility gate's keep rate on a sample of the training questions (with its 95% Wilson
interval), decided by the run's own parsers, embedder, prompts, generator stage and gate; the documents the
document gate retains; and the distiller's prompt kinds timed on the kept examples. The record is of the training
file and the generator's hardware; a plan uses it where both match (`timing`).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.plan.tokens import jsonl_rows, messages_tokens, text_tokens

if TYPE_CHECKING:
    import pandas as pd

SAMPLE_QUESTIONS = 64  # training questions answered both ways: a 95% interval of about +-0.1 at a 20% keep rate
MIN_QUESTIONS = 24  # answered whatever the budget (+-0.16 at 20%): past these, batches go on while the budget lasts
SAMPLE_PASSAGES = 2000  # corpus passages embedded and searched exactly
STAND_INS = 8  # examples the distiller is timed on where the sample keeps none


def wilson(kept: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of `kept` / `n`: it stays in [0, 1] and is not empty at 0 or n kept."""
    if n <= 0:
        return 0.0, 1.0
    p = kept / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def sample_rows(path: str, n: int = SAMPLE_QUESTIONS) -> list[dict[str, Any]]:
    """`n` question rows spread over a local jsonl file, as the run reads them; [] where not readable here."""
    from wbrag_ray.formats import dataset_record

    rows = [r for r in map(dataset_record, jsonl_rows(path)) if isinstance(r, dict)]
    step = max(1, len(rows) // n)
    return rows[::step][:n]


def corpus_passages(path: str | None, n: int) -> list[tuple[str, str]]:
    """(title, text) of a local corpus file's first `n` passages, as the ingest parses them."""
    from wbrag_ray.formats import corpus_record

    parsed = [corpus_record(r) for r in jsonl_rows(path, n) if isinstance(r, dict)]
    return [(p.title, p.text) for p in parsed if not isinstance(p, str)]


def _timed(generate, prompts: list, batch: int) -> dict[str, Any]:
    """Seconds, prompt and generated tokens a call of `prompts` answered in batches, warm; and the answers."""
    from wbrag_ray.plan.measuring import timed_batches

    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    answers: list[str] = []
    n, cold, seconds = timed_batches(lambda b: answers.extend(generate(b)), batches, float("inf"))
    answers = answers[:len(prompts)]
    return {"calls": len(prompts), "seconds": seconds, "seconds_per_call": seconds / max(1, len(prompts)),
            "prompt_tokens": sum(messages_tokens(p) for p in prompts) / max(1, len(prompts)),
            "generated_tokens": _mean_tokens(answers),
            "first_use_seconds": max(0.0, cold - seconds), "answers": answers}


def _mean_tokens(answers: list[str]) -> float:
    return sum(text_tokens(a) for a in answers) / max(1, len(answers))


def search_sample(config: WbragConfig, questions: list[str], passages: list[tuple[str, str]]) -> list[list]:
    """Each question's top K of `passages`, embedded as the run embeds them, by exact inner-product search."""
    import numpy as np
    import pandas as pd

    from wbrag_ray.build_kb import unit_text
    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.retrieval.hits import Hit
    from wbrag_ray.stages.embed import stored

    k = config.retrieval.top_k
    embedder = Embedder(config.retrieval.query_embedder(config.embedder))
    embedder.setup()
    units = pd.DataFrame({"pid": range(len(passages)), "title": [t for t, _ in passages],
                          "text": [x for _, x in passages]})
    vectors = stored(embedder.encode_passages(unit_text(units, "pid")["text"].tolist()), config.embedder)
    scores = embedder.encode_queries(questions) @ vectors.astype(np.float32).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[Hit(int(j), float(scores[i, j]), rank, *passages[int(j)]) for rank, j in enumerate(top)]
            for i, top in enumerate(order)]


def gate_method(rag_method: str) -> str:
    """The method deciding the sample's gate: the run's where it is one-pass text, else naive (said so)."""
    return rag_method if rag_method in ("naive", "replug-vote") else "naive"


def score_sample(config: WbragConfig, rows: list[dict[str, Any]], hits: list[list], generate) -> pd.DataFrame:
    """The utility gate on `rows` with their top K `hits`, as the run decides it (`generate`: a prompts frame ->
    the frame with `answer`). One row per question, in `rows`' order."""
    import pandas as pd

    from wbrag_ray import rag
    from wbrag_ray.retrieval.hits import hits_to_json
    from wbrag_ray.writeback.gates import gate_examples
    from wbrag_ray.writeback.pipeline import with_gate_metric

    wb = with_gate_metric(config.writeback, config.writeback.train)
    method = gate_method(config.writeback.rag_method)
    frame = pd.DataFrame({"id": [r["id"] for r in rows], "question": [r["question"] for r in rows],
                          "golden_answers": [r["golden_answers"] for r in rows],
                          "docs": [hits_to_json(h) for h in hits]})
    answered = rag.combine(generate(rag.expand(frame, ["no-retrieval", method])), "answer")
    examples = gate_examples(answered, method, wb).set_index("id").loc[frame["id"]].reset_index()
    return examples


def run_pass(stage):
    """A prompts frame through the set-up `GenerateStage` in its pass batches, as the run's service sends it."""
    import pandas as pd

    from wbrag_ray.stages.base import process_checked

    def generate(frame: pd.DataFrame) -> pd.DataFrame:
        size = stage.resources.batch_size
        outs = [process_checked(stage, frame.iloc[i:i + size].reset_index(drop=True))
                for i in range(0, len(frame), size)]
        return pd.concat(outs, ignore_index=True) if outs else frame.assign(answer=[])

    return generate


def calibrate_writeback(config: WbragConfig, rows: list[dict[str, Any]], passages: list[tuple[str, str]],
                        corpus_passages: int | None, budget: float) -> dict[str, Any]:
    """Measure the keep rate and the distiller's prompt kinds on `rows` against `passages`."""
    import pandas as pd
    import torch

    from wbrag_ray.generation.stage import GenerateStage
    from wbrag_ray.metrics import metric
    from wbrag_ray.models.hardware import resolved_dtype_name, set_threads
    from wbrag_ray.plan.measuring import hardware
    from wbrag_ray.prompts import extract_messages, rag_messages, rewrite_messages
    from wbrag_ray.writeback.distill import ground_extraction
    from wbrag_ray.writeback.gates import document_gate
    from wbrag_ray.writeback.pipeline import with_gate_metric

    g, k = config.generator, config.retrieval.top_k
    wb = with_gate_metric(config.writeback, config.writeback.train)
    threads = g.threads or set_threads(g.num_cpus)
    if g.threads:
        torch.set_num_threads(g.threads)
    t0 = time.perf_counter()
    hits = search_sample(config, [r["question"] for r in rows], passages)
    search_seconds = time.perf_counter() - t0

    stage = GenerateStage(g, "prompt", "answer")  # the run's generator stage, set up as its service's actor does
    stage.setup()
    gen, batch = stage.generator, max(1, g.batch_size or 16)
    # a part of the sample a pass, until MIN_QUESTIONS are answered and the budget is spent
    part = max(1, stage.resources.batch_size // 2)
    scored = []
    t0 = time.perf_counter()
    while sum(map(len, scored)) < len(rows) and (sum(map(len, scored)) < MIN_QUESTIONS
                                                 or time.perf_counter() - t0 < budget):
        done = sum(map(len, scored))
        scored.append(score_sample(config, rows[done:done + part], hits[done:done + part], run_pass(stage)))
    examples = pd.concat(scored, ignore_index=True)
    rows, hits = rows[:len(examples)], hits[:len(examples)]
    golds = [list(r["golden_answers"]) for r in rows]
    questions = [r["question"] for r in rows]
    s_nr, nr, rag = examples["s_nr"].tolist(), examples["nr_answer"].tolist(), examples["rag_answer"].tolist()
    useful = [i for i, kept in enumerate(examples["useful"]) if kept]
    lo, hi = wilson(len(useful), len(rows))

    # the distiller's prompt kinds, on a batch of the kept examples (or stand-ins where the sample keeps none)
    timed_on = useful[:batch] or list(range(min(STAND_INS, len(rows))))
    singles = [rag_messages(questions[i], [h]) for i in timed_on for h in hits[i]]
    gate = _timed(lambda b: gen.generate(b, g.max_new_tokens), singles, batch)
    retained = []
    for n, i in enumerate(timed_on):
        scores = [metric(wb.metric, a, golds[i]) for a in gate["answers"][n * k:(n + 1) * k]]
        retained.append([hits[i][j] for j in document_gate(scores, s_nr[i], wb.tau_doc, wb.n_min)[0]])
    multiline = gen.with_config(g.model_copy(update={"stop": [s for s in g.stop if "\n" not in s]}))
    extract = _timed(lambda b: multiline.generate(b, wb.extract_max_new_tokens),
                     [extract_messages(questions[i], d) for i, d in zip(timed_on, retained, strict=True)], batch)
    grounded = [ground_extraction(e, d, questions[i])
                for e, d, i in zip(extract["answers"], retained, timed_on, strict=True)]
    rewrite = _timed(lambda b: multiline.generate(b, wb.rewrite_max_new_tokens),
                     [rewrite_messages(questions[i], e) for i, e in zip(timed_on, grounded, strict=True)], batch)
    points = []
    for shape, p, new in (("document gate", gate, g.max_new_tokens), ("extract", extract, wb.extract_max_new_tokens),
                          ("rewrite", rewrite, wb.rewrite_max_new_tokens)):
        points.append({"shape": shape, "new_tokens": new, **{key: v for key, v in p.items() if key != "answers"}})
    device = torch.cuda.get_device_name() if getattr(gen, "device", "cpu").startswith("cuda") else "cpu"
    return {"role": "writeback", "model": g.model, "backend": g.backend, "train": config.writeback.train,
            "top_k": k, "metric": wb.metric, "rag_method": config.writeback.rag_method,
            "questions": len(rows), "kept": len(useful), "keep_rate": len(useful) / max(1, len(rows)),
            "keep_interval": [lo, hi], "retained_docs": sum(map(len, retained)) / max(1, len(retained)),
            "distilled_on": f"{len(timed_on)} kept examples" if useful else f"{len(timed_on)} stand-ins (none of the "
                                                                            "sample kept)",
            "passages_searched": len(passages), "corpus_passages": corpus_passages,
            "search_seconds": search_seconds, "answer_tokens": {"closed-book": _mean_tokens(nr),
                                                                "rag": _mean_tokens(rag)},
            "points": points, "budget_seconds": budget,
            # each sampled question's gate, set against a run's scored examples
            "sample": [{"id": r["id"], "docs": [h.id for h in hs], "s_nr": float(a), "s_rag": float(b), "useful": bool(u)}
                       for r, hs, a, b, u in zip(rows, hits, examples["s_nr"], examples["s_rag"], examples["useful"],
                                                 strict=True)],
            "hardware": hardware(device, resolved_dtype_name(g.dtype, g.num_gpus), threads)}


def describe(record: dict[str, Any]) -> str:
    """One line of a write-back record: the keep rate with its interval and sample, and the prompt kinds."""
    lo, hi = record["keep_interval"]
    searched = record["passages_searched"]
    whole = record.get("corpus_passages") is not None and searched >= record["corpus_passages"]
    kinds = "; ".join(f"{p['shape']} {p['seconds_per_call']:.3g} s a call, {p['prompt_tokens']:.0f} prompt + "
                      f"{p['generated_tokens']:.0f} generated tokens" for p in record["points"])
    return (f"write-back of {record['train']}: the utility gate kept {record['kept']} of {record['questions']} "
            f"sampled training questions ({record['keep_rate']:.1%}, 95% Wilson interval {lo:.1%}-{hi:.1%}; "
            f"{record['metric']}, top {record['top_k']} of "
            f"{'the whole corpus' if whole else f'the first {searched:,} passages (a sample of the corpus)'}"
            + ("" if gate_method(record.get("rag_method", "naive")) == record.get("rag_method", "naive")
               else f", naive prompts standing in for {record['rag_method']}")
            + f"); {record['retained_docs']:.2g} documents retained a kept example; {kinds}"
            + f" (timed on {record['distilled_on']})")
