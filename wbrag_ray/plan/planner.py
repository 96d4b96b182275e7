"""The stages `wbrag run` would run for a config, in its order (`api.run`), each planned by `stages`' rules:
ingest -> embed -> index -> [write-back training] -> [Zero-RAG: mastery, pruners, prediction, every ratio, tuning,
router, the evaluation grid] -> [evaluation, base then base + write-back, when Zero-RAG is off].

Generator calls per question are upper bounds: every method's rounds are counted as taken (FLARE retrieving
for every sentence, Self-RAG retrieving for every question), every write-back example as kept, no answer memo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wbrag_ray.config import ConfigError, GeneratorConfig, WbragConfig
from wbrag_ray.plan.corpus import CorpusSize, corpus_size, question_count
from wbrag_ray.plan.models import model_size, serving_gb
from wbrag_ray.plan.placement import Bundle, Cluster, problems
from wbrag_ray.plan.rates import RATES
from wbrag_ray.plan.stages import (
    IndexSizing,
    Stage,
    embedder_bundle,
    generation_time,
    generator_bundles,
    index_time,
    retrieval_bundles,
    scaled_rate,
    search_time,
    size_index,
    threads_of,
    training_bundles,
    training_time,
)

DIM_ASSUMED = 768


@dataclass
class Plan:
    """A config's plan on a cluster: its stages in run order, and why it cannot be placed (empty: it can)."""

    config_name: str
    cluster: Cluster
    corpus: CorpusSize
    stages: list[Stage]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def places(self) -> bool:
        return not self.problems


def make_plan(config: WbragConfig, cluster: Cluster, passages: int | None = None, run: str | None = None,
              name: str = "") -> Plan:
    """The plan of `config` on `cluster`: every stage's bundles, work and time, and why it cannot be placed."""
    corpus = corpus_size(config, passages, run)
    builder = _Builder(config, cluster, corpus)
    stages = builder.stages()
    found: list[str] = list(builder.refusals)
    where: dict[str, list[str]] = {}  # one problem of the stages that share it (one generator in several stages)
    for stage in stages:
        found += stage.refusals  # refused as configured (a replica no node holds): not packed as well
        placed = [] if stage.refusals else problems(stage.bundles, cluster)
        stage.fits = not stage.refusals and not placed
        for problem in placed:
            where.setdefault(problem, []).append(stage.name)
    found += [f"{', '.join(names)}: {problem}" for problem, names in where.items()]
    warnings = builder.warnings + [f"{s.name}: {idle}" for s in stages if (idle := idle_gpus(s, cluster.gpus))]
    return Plan(name, cluster, corpus, stages, list(dict.fromkeys(found)), list(dict.fromkeys(warnings)))


IDLE_SHARE = 0.25  # a GPU stage that leaves more than this share of the cluster's GPUs idle is warned of


def idle_gpus(stage: Stage, total: float) -> str:
    """Where a GPU stage leaves more than a quarter of the cluster's `total` GPUs idle, a warning with the setting
    that would use them or why none would; "" otherwise."""
    used = stage.gpus
    if not used or used >= (1 - IDLE_SHARE) * total - 1e-9:
        return ""
    return f"{used:g} of the cluster's {total:g} GPUs, {total - used:g} idle; {stage.more_gpus}"


KMEANS_GPU = "k-means trains as one task on one GPU (faiss); the add and merge tasks run on CPUs: nothing spreads it"
RETRIEVAL_GPUS = ("a retrieval pass holds its search actors (index shard groups x retrieval.concurrency) and query "
                  "embedders (retrieval.concurrency): raise retrieval.concurrency to search on more GPUs at once")


class _Builder:
    """One config's stages on one cluster; the base index is sized once (its search actors serve every stage that
    retrieves), and a sizing rule's refusal is kept with its fix."""

    def __init__(self, config: WbragConfig, cluster: Cluster, corpus: CorpusSize):
        self.c, self.cluster, self.corpus = config, cluster, corpus
        self.refusals: list[str] = []
        self.warnings: list[str] = []
        size = model_size(config.embedder.model)
        self.dim = size.hidden or DIM_ASSUMED
        if size.hidden is None:
            self.warnings.append(f"embedder {config.embedder.model}: vector dimension unknown, {DIM_ASSUMED} assumed")
        self.units = corpus.units(config.index.unit)
        self.sizing = self._size(self.units, "index") if self.units else None
        self.nodes = [{"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes]
        self.held = sum(b.count * b.gpus for b in self._retrieval())  # search actors and query embedders
        self.auto: set[str] = set()
        self._decide_auto_concurrency()

    def _decide_auto_concurrency(self) -> None:
        """Each "auto" count (`concurrency`, a training's `num_workers`) as a command would decide it on this
        cluster, empty (`cluster_nodes.auto_concurrency`, the commands' own rule: the generator's GPUs less
        retrieval's, its search actors and query embedders, counted from the index this plan sizes)."""
        from wbrag_ray.cluster_nodes import AUTO_SETTINGS, auto_concurrency, section

        counts = auto_concurrency(self.c, self.nodes, self.held)
        self.c = self.c.model_copy(deep=True)  # the caller's config keeps its "auto"
        for key, n in counts.items():
            setattr(section(self.c, key), AUTO_SETTINGS[key], n)
        self.auto = set(counts)
        self.warnings += [f"{k}.{AUTO_SETTINGS[k]} auto: {n} on this cluster" for k, n in counts.items()]

    def _more(self, key: str) -> str:
        """What would use more GPUs in a stage sized by `key`'s count: "auto" where it is a number, else why auto
        stops where it does (the rule's count on this cluster)."""
        from wbrag_ray.cluster_nodes import AUTO_SETTINGS, auto_concurrency, section

        setting = f"{key}.{AUTO_SETTINGS[key]}"
        config = self.c.model_copy(deep=True)
        setattr(section(config, key), AUTO_SETTINGS[key], "auto")
        n = auto_concurrency(config, self.nodes, self.held)[key]
        parent = key.rsplit(".", 1)[0]
        if AUTO_SETTINGS[key] == "num_workers" and n == section(config, parent).batch_size:
            why = f"a step's batch of {n} examples feeds at most {n} workers: raise {parent}.batch_size"
            return why if key in self.auto else f"set {setting}: auto ({n} here); {why}"
        if key not in self.auto:
            return f"set {setting}: auto ({n} on this cluster)"
        return (f"{setting} auto: {n}, what the cluster holds" + (" beside retrieval's GPUs (search actors, query "
                "embedders)" if key == "generator" and self.held else ""))

    def _size(self, n: int, what: str) -> IndexSizing | None:
        c = self.c
        try:
            return size_index(n, self.dim, c.index, c.retrieval, c.embedder.checkpoint_rows, self.cluster)
        except ValueError as exc:
            self.refusals.append(f"{what}: {exc}")
            return None

    def _parallel(self, tasks: int) -> float:
        return max(1.0, min(self.cluster.cpus, tasks))

    # --- the knowledge base ----------------------------------------------------------------------------------

    def stages(self) -> list[Stage]:
        c = self.c
        out = [self.ingest(), self.embed(), self.index()]
        if c.writeback.train:
            out.append(self.writeback())
        if c.zerorag.enabled:
            out += self.zero_rag()
        elif c.eval.dataset:
            out.append(self.evaluation(False))
            if c.writeback.train and c.writeback.evaluate:
                out.append(self.evaluation(True))
        return out

    def ingest(self) -> Stage:
        p = self.corpus.passages
        if p is None:
            return Stage("ingest", [], "corpus size unknown", how="no time: pass --passages")
        rate = RATES["ingest"]
        corpus_bytes = self.corpus.corpus_bytes or p * RATES["bytes_per_passage"].value
        shards = max(1, math.ceil(corpus_bytes / self.c.ingest.shard_bytes))
        at_once = self._parallel(shards)
        return Stage("ingest", [Bundle("ingest task", shards, 1.0, kind="task")],
                     f"{p:,} passages in {shards:,} shards of ingest.shard_bytes", p / (rate.value * at_once),
                     f"{p:,} / ({rate.value:,g}/s [ingest] x {at_once:g} tasks at once)",
                     rates=("ingest",) + (() if self.corpus.corpus_bytes else ("bytes_per_passage",)))

    def embed(self) -> Stage:
        e, unit, n = self.c.embedder, self.c.index.unit, self.units
        bundle = embedder_bundle(e, "embed actor", e.concurrency, e.num_cpus, "embedder.concurrency")
        work = f"{n:,} {unit}s" if n else "corpus size unknown"
        more = self._more("embedder")
        if not n:
            return Stage("embed", [bundle], work, more_gpus=more)
        if e.num_gpus > 0:
            return Stage("embed", [bundle], work, how=f"no measured rate: {n:,} {unit}s embedded on GPUs",
                         more_gpus=more)
        per_actor, how = scaled_rate("embed", model_size(e.model), threads_of(e.num_cpus, e.threads))
        if per_actor is None:
            return Stage("embed", [bundle], work, how=how)
        if unit == "passage":  # the rate is of sentences; a passage is about this many sentences of tokens
            per_actor /= RATES["sentences_per_passage"].value
            how += f" / {RATES['sentences_per_passage'].value} sentences a passage"
        return Stage("embed", [bundle], work, n / (per_actor * e.concurrency),
                     f"{n:,} / ({how} x {e.concurrency} actors)", more_gpus=more,
                     rates=("embed",) + (("sentences_per_passage",) if unit == "passage" else ()))

    def index(self) -> Stage:
        s, n = self.sizing, self.units
        if s is None or not n:
            return Stage("index", [], "corpus size unknown" if not n else "refused by the sizing rules")
        seconds, how, keys, left_out = index_time(s, n, self.dim, self.cluster.cpus)
        return Stage("index", list(s.bundles), f"{n:,} vectors of {self.dim} dimensions", seconds, how, rates=keys,
                     left_out=left_out, more_gpus=KMEANS_GPU,
                     notes=[s.describe(), f"retrieval service: {s.groups} search actor group(s) of up to "
                            f"{s.group_gb:,.3g} GB (retrieval.actor_memory_gb={self.c.retrieval.actor_memory_gb})"])

    # --- model passes --------------------------------------------------------------------------------------

    def _calls_per_question(self, method: str) -> tuple[int, int]:
        """(prompts without documents, prompts with documents) a method makes per question, at most: they run at
        the closed-book and the RAG-prompt rates. Self-RAG: its retrieval judgement, then a relevance judgement per
        document and the answer; FLARE: a look-ahead and a rewrite with documents per round."""
        k, rounds = self.c.retrieval.top_k, self.c.rag.flare.max_rounds
        return {"no-retrieval": (1, 0), "naive": (0, 1), "replug": (0, k), "replug-vote": (0, k),
                "self-rag": (1, k + 1), "flare": (rounds, rounds)}[method]

    def _per_question(self, methods: list[str]) -> tuple[int, int]:
        calls = [self._calls_per_question(m) for m in methods]
        return sum(c for c, _ in calls), sum(r for _, r in calls)

    def _retrieval(self) -> list[Bundle]:
        if self.sizing is None:
            return []
        c = self.c
        return retrieval_bundles(self.sizing, c.index, c.retrieval, c.embedder, self.cluster)

    def _model_stage(self, name: str, g: GeneratorConfig, questions: int | None, per: tuple[int, int], work: str,
                     retrieval: bool, key: str = "generator") -> Stage:
        """A stage of generator passes: `questions` x `per` (closed-book, with documents) calls on the service of
        `g`, beside the retrieval service when it searches."""
        bundles, notes, refusals = generator_bundles(g, key, self.cluster)
        stage = Stage(name, bundles + (self._retrieval() if retrieval else []), work, 0.0, notes=notes,
                      refusals=refusals, more_gpus=self._more(key))
        if questions is None:
            stage.seconds, stage.how = None, "questions not counted: no time"
            return stage
        for calls, rate in ((per[0], "closed_book"), (per[1], "rag")):
            if calls:
                self._add_time(stage, g, questions * calls, rate)
        return stage

    @staticmethod
    def _add_time(stage: Stage, g: GeneratorConfig, calls: int | None, rate: str, label: str = "") -> None:
        seconds, how, keys = generation_time(g, calls, rate)
        stage.seconds = None if seconds is None or stage.seconds is None else stage.seconds + seconds
        stage.how = f"{stage.how}; {label}{how}" if stage.how else label + how
        stage.rates += keys

    def writeback(self) -> Stage:
        wb, k = self.c.writeback, self.c.retrieval.top_k
        q, counted = question_count(wb.train, wb.limit)
        closed, rag = self._calls_per_question(wb.rag_method)
        per = (1 + closed, rag + k + 2)  # s_nr; s_rag, the document gate, extract + rewrite
        stage = self._model_stage("write-back training", self.c.generator, q, per,
                                  f"questions: {counted}; up to {sum(per)} generator calls each (s_nr, "
                                  f"{wb.rag_method} s_rag, the document gate over K={k}, extract + rewrite)", True)
        stage.notes.append(f"the units are embedded with the embedder's actors and indexed ({wb.index_factory})")
        return stage

    def evaluation(self, writeback: bool) -> Stage:
        ev = self.c.eval
        q, counted = question_count(ev.dataset, ev.limit)
        per = self._per_question(ev.methods)
        name = "evaluation" + (" with write-back" if writeback else "")
        return self._model_stage(name, self.c.generator, q, per, f"questions: {counted}; methods "
                                 f"{', '.join(ev.methods)}: up to {sum(per)} calls a question",
                                 any(m != "no-retrieval" for m in ev.methods))

    # --- Zero-RAG ----------------------------------------------------------------------------------------

    def zero_rag(self) -> list[Stage]:
        c, z = self.c, self.c.zerorag
        out = [self.mastery()]
        for kind in dict.fromkeys([*z.train_pruners, z.pruner]):
            out.append(self.pruner_training(kind))
        out.append(self.prediction())
        out += [self.pruning(r) for r in z.ratios if r > 0]
        q, counted = question_count(z.train, z.train_limit)
        if z.tune.enabled:
            out += self.tuning(q, counted)
        if z.router:
            out.append(self._model_stage("router", c.generator, q, (1, 0), f"training questions: {counted}; one "
                                         "closed-book answer each (labels), embedded in the driver", False))
        if c.eval.dataset:
            n, counted = question_count(c.eval.dataset, c.eval.limit)
            cells = (len({0.0, *z.ratios}) * (2 if z.router else 1) * (2 if z.tune.enabled else 1)
                     * (2 if c.writeback.train else 1))
            closed, rag = self._per_question(c.eval.methods)
            out.append(self._model_stage("evaluation grid", c.generator, n * cells if n else None, (closed, rag),
                                         f"questions: {counted}; {cells} settings (ratios x router x adapter x "
                                         f"write-back) x up to {closed + rag} calls a question", True))
        return out

    def mastery(self) -> Stage:
        z, g = self.c.zerorag, self.c.generator
        sample = min(z.sample, self.corpus.sentences or z.sample)
        if z.qa_mode == "llm":
            answers, written = sample * z.qa_per_sentence, sample
        else:
            answers, written = round(sample * z.qa_per_sentence * RATES["cloze_calls_per_pair"].value), 0
        stage = self._model_stage("mastery", g, answers, (1, 0), f"{sample:,} sentences: {written:,} QA-writing "
                                  f"calls, {answers:,} closed-book answers", False)
        if written:  # the QA writer's prompts hold the sentence and its answers run long: the RAG-prompt rate
            writer = z.qa_generator or g
            if z.qa_generator is not None:
                bundles, notes, refusals = generator_bundles(writer, "zerorag.qa_generator", self.cluster)
                stage.bundles += bundles
                stage.notes += notes
                stage.refusals += refusals
            self._add_time(stage, writer, written, "rag", "QA writing: ")
        return stage

    def pruner_training(self, kind: str) -> Stage:
        z = self.c.zerorag
        fit = max(1, round(z.sample * (1 - z.val_fraction)))
        if kind == "embedding":
            return Stage("pruner training (embedding head)", [], f"a head on {fit:,} stored vectors, in the driver",
                         how="small: not estimated")
        lm = z.lm_pruner
        return self._training("pruner training (LM regressor)", lm.backbone, lm, fit, "zerorag.lm_pruner")

    def _training(self, name: str, model: str, section, examples: int, key: str) -> Stage:
        from wbrag_ray.training.workers import plan_steps

        trainer = section.trainer
        bundles, warn = training_bundles(model, trainer, f"{key}.trainer", self.cluster.gpu_memory_gb)
        self.warnings += [warn] if warn else []
        more = self._more(f"{key}.trainer")
        try:
            steps, batch = plan_steps(section, examples, trainer.num_workers)
        except (ConfigError, ValueError) as exc:
            return Stage(name, bundles, f"{examples:,} examples", refusals=[f"{name}: {exc}"], more_gpus=more)
        seconds, how, keys = training_time(model, trainer, steps, batch, section.max_length)
        capped = f", capped by {key}.max_steps" if section.max_steps and steps == section.max_steps else ""
        return Stage(name, bundles, f"{examples:,} examples: {steps:,} steps of {batch}{capped}, "
                     f"{trainer.num_workers} worker(s)", seconds, how, rates=keys, more_gpus=more)

    def prediction(self) -> Stage:
        z, n = self.c.zerorag, self.corpus.sentences
        work = f"{n:,} sentences" if n else "corpus size unknown"
        if z.pruner == "embedding":
            files = max(1, math.ceil((n or 1) / z.checkpoint_rows))
            rate = RATES["predict_embedding"]
            at_once = self._parallel(files)
            return Stage("prediction (embedding pruner)", [Bundle("prediction task", files, 1.0, kind="task")], work,
                         n / (rate.value * at_once) if n else None,
                         f"{n or 0:,} / ({rate.value:,g} per CPU-second [predict_embedding] x {at_once:g} CPUs)",
                         rates=("predict_embedding",))
        lm = z.lm_pruner
        size, on_gpu = model_size(lm.backbone), lm.num_gpus > 0
        memory = serving_gb(size, "auto", on_gpu)
        bundle = Bundle("LM pruner actor", lm.concurrency, lm.num_cpus, lm.num_gpus, None if on_gpu else memory,
                        memory if on_gpu else None, detail=size.describe(), fix="lower zerorag.lm_pruner.concurrency")
        more = self._more("zerorag.lm_pruner")
        if on_gpu or not n:
            return Stage("prediction (LM pruner)", [bundle], work, how=f"no measured rate: {n or 0:,} sentences "
                         "predicted on GPUs" if on_gpu else "corpus size unknown", more_gpus=more)
        per_actor, how = scaled_rate("predict_lm", size, threads_of(lm.num_cpus, lm.threads))
        seconds = n / (per_actor * lm.concurrency) if per_actor else None
        return Stage("prediction (LM pruner)", [bundle], work, seconds, f"{n:,} / ({how} x {lm.concurrency} actors)",
                     rates=("predict_lm",), more_gpus=more)

    def pruning(self, ratio: float) -> Stage:
        n = self.corpus.sentences
        name = f"pruning at {ratio:g}"
        if not n:
            return Stage(name, [], "corpus size unknown")
        kept = round(n * (1 - ratio))
        sizing = self._size(kept, name)
        rate = RATES["prune"]
        at_once = self._parallel(max(1, math.ceil(n / self.c.zerorag.checkpoint_rows)))
        return Stage(name, list(sizing.bundles) if sizing else [], f"{n:,} sentences -> {kept:,} kept",
                     n / (rate.value * at_once), f"{n:,} / ({rate.value:,g} per CPU-second [prune] x {at_once:g} CPUs)",
                     notes=[f"pruned index: {sizing.describe()}"] if sizing else [], rates=("prune",),
                     more_gpus=KMEANS_GPU)

    def tuning(self, q: int | None, counted: str) -> list[Stage]:
        t, g = self.c.zerorag.tune, self.c.generator
        retrieve = Stage("tuning: retrieval", self._retrieval(), f"training questions: {counted}; top "
                         f"{max(t.retrieve_k, self.c.retrieval.top_k)} each",
                         search_time(q, self.sizing, self.c.retrieval) if self.sizing else None,
                         "CPU search rate [search] x the search actors' CPUs" if q else "questions not counted",
                         rates=("search",) if q else (), more_gpus=RETRIEVAL_GPUS)
        if q:  # relevant, distracting and no documents: at most three rows a question
            return [retrieve, self._training("tuning: LoRA training", g.model, t, 3 * q, "zerorag.tune")]
        if t.max_steps:  # uncounted, but the cap bounds it: as many examples as max_steps full batches take
            stage = self._training("tuning: LoRA training", g.model, t, t.max_steps * t.batch_size, "zerorag.tune")
            stage.work = f"questions not counted: at most {stage.work.split(': ', 1)[-1]}"
            return [retrieve, stage]
        bundles, warn = training_bundles(g.model, t.trainer, "zerorag.tune.trainer", self.cluster.gpu_memory_gb)
        self.warnings += [warn] if warn else []
        return [retrieve, Stage("tuning: LoRA training", bundles, f"questions not counted: {t.epochs:g} epoch(s) "
                                f"over up to 3 rows a question, {t.batch_size} a step", how="no time",
                                more_gpus=self._more("zerorag.tune.trainer"))]
