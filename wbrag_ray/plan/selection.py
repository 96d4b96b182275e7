"""Write-back's figures of a config's own data, measured by `wbrag plan --calibrate` (where `writeback.train` is
set and the generator is not an HTTP endpoint), in one worker with the generator's resources:

    keep rate   the utility gate's share of a sample of the training questions (`SAMPLE_QUESTIONS`, spread over
                the file's first lines), with its 95% Wilson interval: each answered closed-book (s_nr) and from
                its top K of an exact search of the corpus's first `SAMPLE_PASSAGES` passages (s_rag; the whole
                corpus where it is that small, else a sample, said so), scored with the gate's metric
    retained    documents the document gate keeps of a kept example (each document answered alone, as the run
                answers them)
    prompt kinds  the document gate's one-document answers, the distiller's extraction and its rewrite, timed on
                those kept examples (where none is kept, the first sampled examples' top K stand in, said so):
                seconds a call, prompt tokens and generated tokens a call, measured, not an answer call scaled
                by max_new_tokens

The record is of the training file and the generator's hardware; the plan takes it where both match (`timing`).
"""

from __future__ import annotations

import math
import time
from typing import Any

from wbrag_ray.config import WbragConfig
from wbrag_ray.plan.tokens import jsonl_rows, messages_tokens, text_tokens

SAMPLE_QUESTIONS = 64  # training questions answered both ways: a 95% interval of about +-0.1 at a 20% keep rate
MIN_QUESTIONS = 24  # answered whatever the budget (+-0.16 at 20%): past these, batches go on while the budget lasts
SAMPLE_PASSAGES = 2000  # corpus passages embedded and searched exactly
STAND_INS = 8  # examples the distiller is timed on where the sample keeps none


def wilson(kept: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion `kept` / `n` (95% at z = 1.96): unlike p +- z se, it stays in
    [0, 1] and is not empty at 0 or n kept, which a small sample of a low keep rate meets."""
    if n <= 0:
        return 0.0, 1.0
    p = kept / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def sample_rows(path: str, n: int = SAMPLE_QUESTIONS) -> list[dict[str, Any]]:
    """`n` question rows spread evenly over a local jsonl file's first `SAMPLE_LINES` lines ([] where it is not
    readable here)."""
    rows = jsonl_rows(path)
    rows = [r for r in rows if "question" in r and r.get("golden_answers")]
    step = max(1, len(rows) // n)
    return rows[::step][:n]


def _timed(generate, prompts: list, batch: int) -> dict[str, Any]:
    """Seconds a call, prompt and generated tokens a call of `prompts` answered in batches of `batch`, each batch
    run twice (cold, then warm: `measuring.timed_batches`); the answers."""
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


def calibrate_writeback(config: WbragConfig, rows: list[dict[str, Any]], passages: list[tuple[str, str]],
                        corpus_passages: int | None, budget: float) -> dict[str, Any]:
    """Measure the keep rate and the distiller's prompt kinds on `rows` (sampled training questions) against
    `passages` ((title, text), the corpus's first ones; `corpus_passages`: the corpus's count where known)."""
    import numpy as np
    import torch

    from wbrag_ray.generation.backends import make_generator
    from wbrag_ray.metrics import metric
    from wbrag_ray.models.embedder import Embedder
    from wbrag_ray.models.hardware import resolved_dtype_name, set_threads
    from wbrag_ray.plan.measuring import hardware
    from wbrag_ray.prompts import extract_messages, no_retrieval_messages, rag_messages, rewrite_messages
    from wbrag_ray.retrieval.hits import Hit
    from wbrag_ray.writeback.distill import ground_extraction
    from wbrag_ray.writeback.gates import document_gate, utility_gate
    from wbrag_ray.writeback.pipeline import with_gate_metric

    g, k = config.generator, config.retrieval.top_k
    wb = with_gate_metric(config.writeback, config.writeback.train)
    threads = g.threads or set_threads(g.num_cpus)
    if g.threads:
        torch.set_num_threads(g.threads)
    t0 = time.perf_counter()
    embedder = Embedder(config.embedder)
    embedder.setup()
    vectors = embedder.encode_passages([text for _, text in passages])
    queries = embedder.encode_queries([r["question"] for r in rows])
    order = np.argsort(-(queries @ vectors.T), axis=1)[:, :k]
    hits = [[Hit(int(j), 1.0, rank, *passages[int(j)]) for rank, j in enumerate(top)] for top in order]
    search_seconds = time.perf_counter() - t0

    gen = make_generator(g)
    gen.setup()
    batch = max(1, g.batch_size or 16)
    # the answers only decide the gate (the generator record times these prompt kinds): answered once, a batch of
    # questions at a time, until MIN_QUESTIONS are and the budget is spent
    nr: list[str] = []
    rag: list[str] = []
    t0 = time.perf_counter()
    while len(nr) < len(rows) and (len(nr) < MIN_QUESTIONS or time.perf_counter() - t0 < budget):
        part = range(len(nr), min(len(rows), len(nr) + batch))
        nr += gen.generate([no_retrieval_messages(rows[i]["question"]) for i in part], g.max_new_tokens)
        rag += gen.generate([rag_messages(rows[i]["question"], hits[i]) for i in part], g.max_new_tokens)
    rows, hits = rows[:len(nr)], hits[:len(nr)]
    golds = [[str(a) for a in r["golden_answers"]] for r in rows]
    questions = [r["question"] for r in rows]
    s_nr = [metric(wb.metric, a, gd) for a, gd in zip(nr, golds, strict=True)]
    s_rag = [metric(wb.metric, a, gd) for a, gd in zip(rag, golds, strict=True)]
    useful = [i for i in range(len(rows)) if utility_gate(s_rag[i], s_nr[i], wb.tau_s, wb.tau_delta)]
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
            + ("" if record.get("rag_method") == "naive" else f", naive prompts standing in for {record['rag_method']}")
            + f"); {record['retained_docs']:.2g} documents retained a kept example; {kinds}"
            + f" (timed on {record['distilled_on']})")
