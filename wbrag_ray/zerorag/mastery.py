"""Zero-RAG step 1: sample sentences (a uniform sample, the same on any number of nodes and in any order) -> QA
pairs -> the target model's closed-book answers -> mean exact match per sentence (RUN/zero_rag/mastery/)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

import wbrag_ray.zerorag.qa as m
from wbrag_ray import prompts
from wbrag_ray.build_kb import INDEX, INGEST
from wbrag_ray.config import ConfigError, WbragConfig
from wbrag_ray.formats import plain_table
from wbrag_ray.generation.passes import GeneratorPasses
from wbrag_ray.papers import ZERO_RAG, print_departures
from wbrag_ray.ray_runtime import LIGHT_CPUS, read_parquet, select_rows
from wbrag_ray.run import RunFolder, RunStage
from wbrag_ray.work import Generate, Pass, Sizes


def splitmix64(x: np.ndarray, seed: int) -> np.ndarray:
    """A well-mixed 64-bit hash of each id: the same sample on any number of nodes, in any order."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_sentences(run: RunFolder, seed: int, n: int) -> pd.DataFrame:
    """The `n` sentences with the smallest `seed`ed hash of their sid: a distributed filter, then an exact cut."""
    import ray
    import ray.data

    total = run.stats("ingest")["sentences"]
    src = run.layout.ingest.sentences
    frac = _sample_fraction(n, total)
    while True:
        cut = np.uint64(min(2**64 - 1, int(frac * (2**64 - 1))))

        def below(batch: pa.Table, cut=cut) -> pa.Table:
            keys = splitmix64(batch["sid"].to_numpy(), seed)
            return batch.append_column("_key", pa.array(keys)).filter(pa.array(keys <= cut))

        ds = read_parquet(src, columns=["sid", "pid", "text"])
        ds = ds.map_batches(below, batch_format="pyarrow", num_cpus=LIGHT_CPUS)
        tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
        found = pa.concat_tables(tables).to_pandas() if tables else pd.DataFrame(columns=["sid", "pid", "text", "_key"])
        if len(found) >= min(n, total) or frac >= 1.0:
            break
        frac = min(1.0, frac * 2)  # too few below the cut (the margin makes this rare): widen it and rescan
    found = found.sort_values("_key", kind="stable").head(n).drop(columns="_key")
    titles = select_rows(run.layout.ingest.passages, "pid", found["pid"].to_numpy(), ["pid", "title"])
    found["title"] = found["pid"].map(titles.set_index("pid")["title"]).fillna("")
    return found.sort_values("sid").reset_index(drop=True)


def _sample_fraction(n: int, total: int) -> float:
    """Hash cut with a margin of five standard deviations, so one pass almost always finds n candidates."""
    p = n / max(total, 1)
    return min(1.0, p + 5 * np.sqrt(p * (1 - p) / max(total, 1)) + 16 / max(total, 1))


def titled(titles, texts) -> list[str]:
    """'title: sentence', what a sentence is about and what it says: the QA writer's input and the LM pruner's."""
    return [f"{t}: {x}" if t else x for t, x in zip(titles, texts, strict=True)]


def mastery(run: RunFolder, config: WbragConfig, sample: int | None = None, force: bool = False) -> dict[str, Any]:
    """Score a sample of sentences: QA pairs -> the target model's closed-book answers -> mean EM."""
    if config.index.unit != "sentence":  # the pruned index holds sentences; the embedding pruner reads their vectors
        raise ConfigError("Zero-RAG prunes sentences: set index.unit=sentence (the index holds sentences and the "
                          "embedding pruner reads their stored vectors); e.g. jobs/configs/zero_rag_demo.yaml")
    run.require(INDEX)
    print_departures(config, ZERO_RAG)
    n = sample or config.zerorag.sample
    return run.execute(MASTERY, config, lambda: _score(run, config, n), params={"sample": n}, force=force)


def _score(run: RunFolder, config: WbragConfig, n: int) -> dict[str, Any]:
    z = config.zerorag
    out = run.layout.zero_rag
    t0 = time.perf_counter()
    total = run.stats(INGEST.name)["sentences"]
    sentences = sample_sentences(run, z.seed, n)
    with GeneratorPasses(config.generator) as passes:
        rows: list[dict] = []
        if z.qa_mode == "cloze":
            for s in sentences.itertuples(index=False):
                rows += [{"sid": s.sid, **r} for r in m.cloze_pairs(s.title, s.text, z.qa_per_sentence)]
        else:
            qa_gen = z.qa_generator or config.generator
            write = sentences[["sid", "title", "text"]].copy()
            write["qa_prompt"] = [prompts.dumps(prompts.qa_write_messages(x, z.qa_per_sentence, qa_gen.chat_template))
                                  for x in titled(write["title"], write["text"])]
            written = passes.generate("qa_write", write, "qa_prompt", "qa_raw", z.qa_max_new_tokens, qa_gen,
                                      multiline=True,
                                      key="zerorag.qa_generator" if z.qa_generator is not None else "generator")
            prefix = "" if qa_gen.chat_template else prompts.QA_FEWSHOT_PREFIX
            for s in written.sort_values("sid").itertuples(index=False):
                rows += [{"sid": s.sid, **r} for r in m.llm_pairs(s.text, s.qa_raw, z.qa_per_sentence, prefix)]
        qa = pd.DataFrame(rows, columns=["sid", "qa_index", "question", "answer", "status", "raw"])
        qa["qa_index"] = qa["qa_index"].astype("int32")
        ok = qa[qa["status"] == m.OK].copy()
        ok["answer_prompt"] = [prompts.dumps(prompts.closed_book_messages(q, z.qa_mode == "cloze")) for q in ok["question"]]
        predictions = pd.Series(dtype="object")
        if len(ok):
            answered = passes.generate("closed_book", ok[["sid", "qa_index", "answer_prompt"]],
                                       "answer_prompt", "prediction", z.answer_max_new_tokens)
            predictions = answered.set_index(["sid", "qa_index"])["prediction"]
    qa["prediction"] = [predictions.get((s, i)) for s, i in zip(qa["sid"], qa["qa_index"], strict=True)]
    qa = m.score_answers(qa)
    scores = m.mastery_scores(sentences, qa, z.mastery_metric)
    mastery = run.output(out.mastery)  # beside the scored sample while --force redoes it
    mastery.delete()
    mastery.join(out.qa.name).write_table(plain_table(qa))
    mastery.join(out.scores.name).write_table(plain_table(scores))
    counts = qa["status"].value_counts()
    scored = scores["mastery"].notna()
    stats = {
        "mode": z.qa_mode, "metric": z.mastery_metric, "sample": n, "sentences": len(sentences), "qa_pairs": len(qa),
        "valid": int(counts.get(m.OK, 0)), "unparseable": int(counts.get(m.UNPARSEABLE, 0)),
        "answer_not_in_sentence": int(counts.get(m.NOT_IN_SENTENCE, 0)),
        "scored_sentences": int(scored.sum()),
        "mean_mastery": round(float(scores.loc[scored, "mastery"].mean()), 4) if scored.any() else None,
        "generator_calls": passes.calls, "passes": passes.stats,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    stats["calls_per_s"] = round(stats["generator_calls"] / stats["seconds"], 2) if stats["seconds"] else 0.0
    stats["generator_calls_per_sentence"] = round(passes.calls / max(1, len(sentences)), 2)
    mastery.join(out.mastery_stats.name).write_json(stats)
    return {"rows_in": total, "rows_out": int(scored.sum()), "rows_rejected": int((~scored).sum()), **stats}


def mastery_work(config: WbragConfig, sizes: Sizes, params: dict[str, Any]) -> list[Generate]:
    """The sample's closed-book answers (a cloze answer's prompt is few-shot), and in llm mode the QA pairs written
    first, a call a sentence, by zerorag.qa_generator (or the generator)."""
    z = config.zerorag
    sample = min(z.sample, sizes.sentences or z.sample)
    if z.qa_mode == "llm":
        answers, written = sample * z.qa_per_sentence, sample
    else:  # cloze writes a pair only where a sentence has something to blank
        answers, written = round(sample * z.qa_per_sentence * sizes.figure("cloze_calls_per_pair")), 0
    cloze = z.qa_mode == "cloze"
    answer = Pass(1, 0, z.answer_max_new_tokens, prompt=(lambda q, _: prompts.closed_book_messages(q, cloze=True))
                  if cloze else None, question="sentence" if cloze else None)
    work = [Generate(answers, (answer,), f"{sample:,} sentences: {written:,} QA-writing calls, {answers:,} "
                     "closed-book answers")]
    if written:
        writer = z.qa_generator or config.generator
        write = Pass(1, 0, z.qa_max_new_tokens, question="sentence", prompt=lambda q, _: prompts.qa_write_messages(
            q, z.qa_per_sentence, writer.chat_template))
        work.append(Generate(written, (write,), "QA writing: ",
                             section="zerorag.qa_generator" if z.qa_generator is not None else "generator"))
    return work


MASTERY = RunStage(
    "mastery",
    settings=("zerorag.seed", "zerorag.qa_mode", "zerorag.qa_per_sentence", "zerorag.qa_generator",
              "zerorag.qa_max_new_tokens", "zerorag.answer_max_new_tokens", "zerorag.mastery_metric", "generator"),
    requires=(INGEST,), command="wbrag mastery RUN", work=mastery_work,
    run=lambda folder, config, force, services, params: mastery(folder, config, force=force),
    instances=lambda config: [{}] if config.zerorag.enabled else [],
    resources=("generator", "zerorag.qa_generator"), outputs=("zero_rag/mastery",))
