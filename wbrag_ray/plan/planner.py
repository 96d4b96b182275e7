"""The plan of a config: the registry's stages (`pipeline`) in run order, each priced from the work it declares
(`wbrag_ray.work`) with `stages`' rules and `timing`'s rates. Generator calls are upper bounds where a method
decides at run time (FLARE, Self-RAG). Over 500 lines: one builder, a method a kind of work."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wbrag_ray.config import ConfigError, EmbedderConfig, GeneratorConfig, WbragConfig
from wbrag_ray.formats import dataset_name
from wbrag_ray.models.accelerators import DEFAULT_GPU, Accelerator, accelerator
from wbrag_ray.models.hardware import threads_of
from wbrag_ray.models.size import embedding_dim, model_size, serving_gb
from wbrag_ray.pipeline import instances
from wbrag_ray.placement import Bundle, Cluster, problems
from wbrag_ray.placement.gpus import (
    AUTO_SETTINGS,
    apply_gpu_layout,
    auto_concurrency,
    decide_counts,
    index_on_gpu,
    needs_layout,
    section,
)
from wbrag_ray.plan.accelerators import (
    DEFAULT_INTERCONNECT,
    STORAGE_READ_GBS,
    Interconnect,
    encode_seconds,
    interconnect,
)
from wbrag_ray.plan.corpus import CorpusSize, corpus_size, question_count
from wbrag_ray.plan.rates import RATES
from wbrag_ray.plan.stages import (
    IndexSizing,
    Stage,
    Time,
    embedder_bundle,
    generator_bundles,
    index_time,
    retrieval_bundles,
    scaled_rate,
    search_time,
    size_index,
    training_bundles,
)
from wbrag_ray.plan.timing import EMBED_PASS, Timing, describe_record
from wbrag_ray.plan.tokens import TokenShape, token_shape
from wbrag_ray.run import RunStage
from wbrag_ray.training.workers import plan_steps
from wbrag_ray.work import AddVectors, Embed, Generate, Pass, Predict, ReadCorpus, Search, Train

DIM_ASSUMED = 768
HEAD_SECONDS = 5.0  # the embedding pruner's head: a regression on a few thousand stored vectors, in the driver


@dataclass
class Plan:
    """A config's plan on a cluster: its stages in run order, and why it cannot be placed (empty: it can)."""

    config_name: str
    cluster: Cluster
    corpus: CorpusSize
    stages: list[Stage]
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    gpu: Accelerator = field(default_factory=lambda: accelerator(DEFAULT_GPU))
    tokens: TokenShape | None = None
    start_seconds: float = 0.0  # the run's start (the driver, Ray), calibrated; 0 without a record
    calibrated: list[str] = field(default_factory=list)  # the calibration records the plan used, described
    gpu_hour_price: float | None = None
    network: Interconnect | None = None  # between nodes, for the collectives of multi-node stages
    storage_gbs: float = STORAGE_READ_GBS

    @property
    def places(self) -> bool:
        return not self.problems


def make_plan(config: WbragConfig, cluster: Cluster, passages: int | None = None, run: str | None = None,
              name: str = "", gpu: str = DEFAULT_GPU, records: list[dict] | None = None,
              gpu_hour_price: float | None = None, network: str = DEFAULT_INTERCONNECT,
              storage_gbs: float = STORAGE_READ_GBS) -> Plan:
    """The plan of `config` on `cluster`: every stage's bundles, work and time, and why it cannot be placed.
    `gpu`, `network`: names for GPU-stage estimates; `records`: calibration records a stage's hardware may match."""
    corpus = corpus_size(config, passages, run)
    per_node = int(max((n.gpus for n in cluster.nodes), default=0)) or 1
    timing = Timing(accelerator(gpu), list(records or []), token_shape(config), interconnect(network), storage_gbs,
                    per_node)
    builder = _Builder(config, cluster, corpus, timing)
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
    if timing.stale and not any(r.get("role") == "generator" for r in timing.used):
        warnings.append(f"a calibration of {timing.stale[0].get('model')} ({timing.stale[0].get('date')}) counted "
                        "prompt tokens as an earlier version did and is not used: run `wbrag plan CONFIG --calibrate` "
                        "again")
    start = timing.cluster_start(cluster.cpus)
    return Plan(name, cluster, corpus, stages, list(dict.fromkeys(found)), list(dict.fromkeys(warnings)),
                timing.gpu, timing.shape, start, [describe_record(r) for r in timing.used], gpu_hour_price,
                timing.net, timing.storage_gbs)


IDLE_SHARE = 0.25  # a GPU stage that leaves more than this share of the cluster's GPUs idle is warned of


def idle_gpus(stage: Stage, total: float) -> str:
    """A warning where a GPU stage leaves more than `IDLE_SHARE` of the cluster's GPUs idle; "" otherwise."""
    used = stage.gpus
    if not used or used >= (1 - IDLE_SHARE) * total - 1e-9:
        return ""
    return f"{used:g} of the cluster's {total:g} GPUs, {total - used:g} idle; {stage.more_gpus}"


KMEANS_GPU = "k-means trains as one task on one GPU (faiss); the add and merge tasks run on CPUs: nothing spreads it"
RETRIEVAL_GPUS = ("a retrieval pass holds its search actors (index shard groups x retrieval.concurrency) and query "
                  "embedders (retrieval.concurrency): raise retrieval.concurrency to search on more GPUs at once")


class _Builder:
    """One config's stages on one cluster; the base index is sized once (its search actors serve every stage)."""

    def __init__(self, config: WbragConfig, cluster: Cluster, corpus: CorpusSize, timing: Timing):
        self.c, self.cluster, self.corpus, self.timing = config, cluster, corpus, timing
        # the sizes a step's declared work asks for (`work.Sizes`)
        self.passages, self.sentences, self.units, self.questions = (corpus.passages, corpus.sentences, corpus.units,
                                                                     question_count)
        self.refusals: list[str] = []
        self.warnings: list[str] = []
        self._selection: tuple[float, float, str] | None = None
        dim, self.dim_source = embedding_dim(config.embedder.model, model_size(config.embedder.model))
        self.dim = dim or DIM_ASSUMED
        if dim is None:
            self.dim_source = f"{DIM_ASSUMED} assumed"
            self.warnings.append(f"embedder {config.embedder.model}: vector dimension unknown, {DIM_ASSUMED} assumed")
        units = corpus.units(config.index.unit)
        self.sizing = self._size(units, "index") if units else None
        self.nodes = cluster.resources()
        self._decide_auto()

    def _decide_auto(self) -> None:
        """The "auto" settings as a command decides them on this cluster (`placement.gpus`: `apply_gpu_layout`, then
        `decide_counts`); a GPU cluster's faiss is assumed to have GPU support."""
        self.c = c = self.c.model_copy(deep=True)  # the caller's config keeps its "auto"
        gpus, layout = self.cluster.gpus, None
        search = ((self.sizing.groups * c.retrieval.concurrency, self.sizing.group_gb * 1e9)
                  if self.sizing and gpus > 0 and c.index.gpu is not False else (0, 0.0))
        if needs_layout(c):
            try:
                index_on_gpu(c.index.gpu, gpus, gpus > 0)
                said, layout = apply_gpu_layout(c, self.nodes, search, self.cluster.gpu_memory_gb)
                self.warnings += said
            except ConfigError as exc:
                self.refusals.append(str(exc))
                g = c.generator
                if g.tensor_parallel_size == "auto":  # refused: planned at a node's largest size, to show the rest
                    size = model_size(g.model)
                    most = int(max((n.gpus for n in self.cluster.nodes), default=1) or 1)
                    g.num_gpus = float(max(size.tensor_parallel_sizes(most)) * g.pipeline_parallel_size)
                    g.tensor_parallel_size = int(g.num_gpus) // g.pipeline_parallel_size
        counts, self.held = decide_counts(c, self.nodes, search, layout)
        self.auto = set(counts)
        self.warnings += [f"{k}.{AUTO_SETTINGS[k]} auto: {n} on this cluster" for k, n in counts.items()]

    def _more(self, key: str) -> str:
        """What would use more GPUs in a stage sized by `key`'s count, or why "auto" stops where it does."""
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

    # --- the registry's stages, each priced from the work it declares ----------------------------------------

    def stages(self) -> list[Stage]:
        return [planned for stage, params in instances(self.c) for planned in self.price(stage, params)]

    def price(self, stage: RunStage, params: dict) -> list[Stage]:
        """A run stage's planned stages: a titled search before it, then its work items priced into one stage."""
        name, out, main = stage.heading(params), [], None
        for item in stage.work(self.c, self, params):
            if isinstance(item, Search) and item.title:
                out.append(self.search(item))
            elif main is None:
                main = self.PRICE[type(item)](self, name, item)
            elif isinstance(item, Generate):
                self._also_generate(main, item)
            elif isinstance(item, Embed):
                self._query_embedder(main)
        if main is not None:
            main.measured_by = stage.pattern(params)
            out.append(main)
        return out

    def selection(self) -> tuple[float, float, str]:
        if self._selection is None:
            self._selection = self._keep_rate(self._writeback_record())
        return self._selection

    def tokens(self, what: str, docs: int = 0) -> float:
        shape = self.timing.shape
        return {"title": lambda: shape.title, "sentence": self._sentence_tokens, "unit": lambda: self._doc_tokens,
                "prompt": lambda: shape.prompt(docs, self._doc_tokens) if docs else shape.prompt(0)}[what]()

    def figure(self, key: str) -> float:
        return RATES[key].value

    # --- pricing, one method a kind of work ---------------------------------------------------------------------

    def ingest(self, name: str, item: ReadCorpus) -> Stage:
        p = item.passages
        if p is None:
            return Stage(name, [], "corpus size unknown", how="no time: pass --passages")
        rate = RATES["ingest"]
        corpus_bytes = self.corpus.corpus_bytes or p * RATES["bytes_per_passage"].value
        shards = max(1, math.ceil(corpus_bytes / self.c.ingest.shard_bytes))
        at_once = self._parallel(shards)
        return Stage(name, [Bundle("ingest task", shards, 1.0, kind="task")],
                     f"{p:,} passages in {shards:,} shards of ingest.shard_bytes", p / (rate.value * at_once),
                     f"{p:,} / ({rate.value:,g}/s [ingest] x {at_once:g} tasks at once)",
                     rates=("ingest",) + (() if self.corpus.corpus_bytes else ("bytes_per_passage",)))

    def embed(self, name: str, item: Embed) -> Stage:
        e, unit, n = self.c.embedder, item.unit, item.texts
        bundle = embedder_bundle(e, "embed actor", e.concurrency, e.num_cpus, "embedder.concurrency")
        stage = Stage(name, [bundle], f"{n:,} {unit}s" if n else "corpus size unknown", more_gpus=self._more("embedder"))
        if not n:
            return stage
        stage.seconds = 0.0
        time = self.timing.embedding(e, n, unit, self.timing.shape.passage if unit == "passage"
                                     else self._sentence_tokens())
        stage.add(time)
        if time.source is not None:  # calibrated or estimated: the actors' start and load besides
            stage.notes.append(f"tokens: {self.timing.shape.source}")
            self._start(stage, "embedder", e, service=EMBED_PASS, actors=e.concurrency)
        return stage

    def add_vectors(self, name: str, item: AddVectors) -> Stage:
        return self.index(name, item) if item.pruned_from is None else self.pruning(name, item)

    def _sentence_tokens(self) -> float:
        """A sentence's tokens: from the ingest's counts where it has them."""
        c = self.corpus
        if c.passages and c.sentences and not c.rates:
            return self.timing.shape.passage * c.passages / c.sentences
        return self.timing.shape.sentence

    def index(self, name: str, item: AddVectors) -> Stage:
        s, n = self.sizing, item.vectors
        if s is None or not n:
            return Stage(name, [], "corpus size unknown" if not n else "refused by the sizing rules")
        tasks, kmeans = index_time(s, n, self.dim, self.cluster.cpus, self.timing.gpu)
        stage = Stage(name, list(s.bundles), f"{n:,} vectors of {self.dim} dimensions ({self.dim_source})", 0.0,
                      more_gpus=KMEANS_GPU,
                      notes=[s.describe(), f"retrieval service: {s.groups} search actor group(s) of up to "
                             f"{s.group_gb:,.3g} GB (retrieval.actor_memory_gb={self.c.retrieval.actor_memory_gb})"])
        stage.add(tasks)
        if kmeans:  # on a GPU: its GPU-seconds count in the GPU-hours
            stage.add(kmeans)
            stage.task_gpu_seconds = kmeans.seconds
        ic = self.c.index
        if ic.target_recall is not None and ("IVF" in s.factory or "HNSW" in s.factory):
            flops = 2.0 * ic.recall_queries * n * self.dim
            stage.notes.append(f"search setting measured to recall@10 {ic.target_recall:g} of exact search: "
                               f"{ic.recall_queries} exact searches over every vector ({flops:.2g} FLOPs, a task "
                               "per embedding shard), then a few searches of them per shard")
        return stage

    # --- model passes --------------------------------------------------------------------------------------

    @property
    def _doc_tokens(self) -> float:
        """A retrieved document's tokens: the index unit's (a passage, or a sentence of Zero-RAG's index)."""
        return self.timing.shape.passage if self.c.index.unit == "passage" else self._sentence_tokens()

    def _retrieval(self) -> list[Bundle]:
        if self.sizing is None:
            return []
        c = self.c
        return retrieval_bundles(self.sizing, c.index, c.retrieval, c.embedder, self.cluster)

    def _model_stage(self, name: str, g: GeneratorConfig, questions: int | None, passes: list[Pass], work: str,
                     retrieval: bool, key: str = "generator", kinds: dict | None = None) -> Stage:
        """A stage of generator passes on `g`'s service; `kinds`: a record whose prompt kinds time them."""
        bundles, notes, refusals = generator_bundles(g, key, self.cluster)
        stage = Stage(name, bundles + (self._retrieval() if retrieval else []), work, 0.0, notes=notes,
                      refusals=refusals, more_gpus=self._more(key))
        if questions is None:
            stage.seconds, stage.how = None, "questions not counted: no time"
            return stage
        self._start(stage, "generator", g, actors=g.concurrency)
        if retrieval:
            self._query_embedder(stage)
        for p in passes:
            self._add_time(stage, g, round(questions * p.calls), p, kinds=kinds)
        return stage

    def generate(self, name: str, item: Generate) -> Stage:
        """Generator passes on the service of the item's config section."""
        measured = self._writeback_record() if item.selection else None
        stage = self._model_stage(name, section(self.c, item.section), item.items, list(item.passes), item.describe,
                                  item.retrieval, item.section, kinds=measured)
        if item.selection:
            self._selection_notes(stage, item, measured)
        return stage

    def _also_generate(self, stage: Stage, item: Generate) -> None:
        """A second generator pass in the same stage (mastery's QA writing), with its own section's bundles."""
        g = section(self.c, item.section)
        if item.section != "generator":
            if (g.backend == "openai" or not g.num_gpus) and stage.seconds is not None:
                stage.held_seconds = stage.seconds
                stage.notes.append(f"the generator's GPUs are held for the answer pass only ({stage.seconds:,.0f} s; "
                                   "the QA pairs are written first, without them)")
            bundles, notes, refusals = generator_bundles(g, item.section, self.cluster)
            stage.bundles += bundles
            stage.notes += notes
            stage.refusals += refusals
        self._start(stage, "generator", g)
        for p in item.passes:
            self._add_time(stage, g, None if item.items is None else round(item.items * p.calls), p, item.describe)

    def _query_embedder(self, stage: Stage) -> None:
        self._start(stage, "embedder", self.c.retrieval.query_embedder(self.c.embedder), service="query embedder",
                    actors=self.c.retrieval.concurrency)

    def _start(self, stage: Stage, role: str, s: EmbedderConfig | GeneratorConfig, service: str | None = None,
               actors: int = 1) -> None:
        """Add the start of a service of config section `s` (its `actors` spread over the nodes)."""
        per_node = max(1, math.ceil(actors / max(1, len(self.cluster.nodes))))
        time = self.timing.service_start(role, s, service, per_node)
        if time.seconds:
            stage.add(time)

    def _add_time(self, stage: Stage, g: GeneratorConfig, calls: int | None, p: Pass, label: str = "",
                  kinds: dict | None = None) -> None:
        if calls is None:
            return stage.add(Time(None, "questions not counted: no time"), label)
        point = next((pt for pt in (kinds or {}).get("points", []) if pt["shape"] == p.kind), None)
        stage.add(self.timing.generation(g, calls, p, self._doc_tokens, point), label)

    def _writeback_record(self) -> dict | None:
        """The write-back record of this training set, K and generator hardware, where calibrated."""
        train = self.c.writeback.train
        return self.timing.record_of("writeback", self.c.generator, train=train,
                                     top_k=self.c.retrieval.top_k) if train else None

    def _selection_notes(self, stage: Stage, item: Generate, measured: dict | None) -> None:
        """Write-back's keep rate and distiller calls: measured, or the paper's or the demo's figures, said so."""
        why = self.selection()[2]
        q = item.items
        calls = sum(p.calls for p in item.passes)
        if measured is None:
            stage.rates += ("writeback_selection",) if "demo" in why else ("writeback_selection_nq",)
        paper = RATES["writeback_calls_nq"]
        if measured is None and "paper" in why and q:
            stage.notes.append(f"the paper states about {paper.value:,.0f} generator calls for NQ's training set "
                               f"[writeback_calls_nq] (its distiller one call a kept example); this plan counts "
                               f"{q * calls:,.0f} (extraction and rewrite two calls, as `writeback.distill` runs)")
            stage.rates += ("writeback_calls_nq",)
        stage.notes.append(f"the units are embedded with the embedder's actors and indexed ({self.c.writeback.index_factory})")

    def _keep_rate(self, measured: dict | None) -> tuple[float, float, str]:
        """(the utility gate's keep rate, documents the document gate retains, where they come from)."""
        wb, k = self.c.writeback, self.c.retrieval.top_k
        if measured is not None:
            lo, hi = measured["keep_interval"]
            return (measured["keep_rate"], measured["retained_docs"],
                    f"{measured['kept']} of {measured['questions']} sampled, 95% interval {lo:.0%}-{hi:.0%} "
                    "[calibrated]")

        if dataset_name(wb.train) == "nq" and "train" in wb.train.rsplit("/", 1)[-1] and k == 5:
            return (RATES["writeback_selection_nq"].value, k,
                    "the paper's NQ figure [writeback_selection_nq]; assumed: `wbrag plan --calibrate` measures it "
                    "where the training set is local; retained documents assumed K")
        self.warnings.append("write-back: the utility gate's keep rate is the demo's "
                             f"{RATES['writeback_selection'].value:.1%} [writeback_selection], and the distiller's "
                             "calls are timed at their max_new_tokens: `wbrag plan CONFIG --calibrate` measures them "
                             "on this config's own training questions and corpus")
        return RATES["writeback_selection"].value, k, "the demo's [writeback_selection], assumed; retained K assumed"

    # --- training -------------------------------------------------------------------------------------------

    def train(self, name: str, item: Train) -> Stage:
        """A Ray Train stage (or a small head in the driver), after the generator pass that makes its targets."""
        if item.head:
            return Stage(name, [], item.rows, HEAD_SECONDS, f"small: about {HEAD_SECONDS:g} s (a head on stored vectors)")
        sec = section(self.c, item.section)
        if item.examples is not None:
            stage = self._training(name, item.model, sec, item.examples, item.section, item.row_tokens, item.rows)
        elif sec.max_steps:  # uncounted, but the cap bounds it: as many examples as max_steps full batches take
            stage = self._training(name, item.model, sec, sec.max_steps * sec.batch_size, item.section,
                                   item.row_tokens, item.rows)
            stage.work = f"questions not counted: at most {stage.work.split(': ', 1)[-1]}"
        else:
            bundles, warn = training_bundles(item.model, sec.trainer, f"{item.section}.trainer",
                                             self.cluster.gpu_memory_gb, self.timing.gpus_per_node)
            self.warnings += [warn] if warn else []
            stage = Stage(name, bundles, f"questions not counted: {sec.epochs:g} epoch(s) over up to 3 rows a "
                          f"question, {sec.batch_size} a step", how="no time",
                          more_gpus=self._more(f"{item.section}.trainer"))
        if item.first is not None and (item.examples is not None or sec.max_steps):
            own = self._model_stage("own answers", section(self.c, item.first.section), item.first.items,
                                    list(item.first.passes), "", False)
            stage.work += f"; {item.first.describe}"
            stage.rates += tuple(r for r in own.rates if r not in stage.rates)
            stage.seconds = None if own.seconds is None or stage.seconds is None else own.seconds + stage.seconds
            stage.how = f"own answers: {own.how}; then {stage.how}"
            for source, seconds in own.sources.items():
                stage.add_source(source, seconds)
        self.timing.started.clear()  # after a Ray Train stage the services start again: its workers took their resources
        return stage

    def _training(self, name: str, model: str, section, examples: int, key: str, row_tokens: float,
                  rows: str) -> Stage:
        """A Ray Train stage of `examples` rows of `row_tokens`: compute, collectives, load and Ray Train's start."""
        trainer = section.trainer
        bundles, warn = training_bundles(model, trainer, f"{key}.trainer", self.cluster.gpu_memory_gb,
                                         self.timing.gpus_per_node)
        self.warnings += [warn] if warn else []
        more = self._more(f"{key}.trainer")
        try:
            steps, batch = plan_steps(section, examples, trainer.num_workers)
        except (ConfigError, ValueError) as exc:
            return Stage(name, bundles, f"{examples:,} examples", refusals=[f"{name}: {exc}"], more_gpus=more)
        compute, start, parts = self.timing.training(model, section, steps, batch, row_tokens, self.c.generator.model)
        capped = f", capped by {key}.max_steps" if section.max_steps and steps == section.max_steps else ""
        stage = Stage(name, bundles, f"{examples:,} examples: {steps:,} steps of {batch}{capped}, "
                      f"{trainer.num_workers} worker(s); {rows}: {steps * batch * row_tokens:,.0f} tokens", 0.0,
                      more_gpus=more)
        stage.add(compute)
        if stage.seconds is not None:
            stage.add(start)
            if len(parts) > 1:  # the estimate's parts, each on its own line of the plan
                stage.notes.append("time by part: " + ", ".join(f"{k} {v:,.0f} s" for k, v in parts.items())
                                   + f", Ray Train start {start.seconds:.0f} s")
        return stage

    def prediction(self, name: str, item: Predict) -> Stage:
        z, n = self.c.zerorag, item.sentences
        work = f"{n:,} sentences" if n else "corpus size unknown"
        if z.pruner == "embedding":
            files = max(1, math.ceil((n or 1) / z.checkpoint_rows))
            rate = RATES["predict_embedding"]
            at_once = self._parallel(files)
            return Stage(name, [Bundle("prediction task", files, 1.0, kind="task")], work,
                         n / (rate.value * at_once) if n else None,
                         f"{n or 0:,} / ({rate.value:,g} per CPU-second [predict_embedding] x {at_once:g} CPUs)",
                         rates=("predict_embedding",))
        lm = z.lm_pruner
        size, on_gpu = model_size(lm.backbone), lm.num_gpus > 0
        memory = serving_gb(size, "auto", on_gpu)
        bundle = Bundle("LM pruner actor", lm.concurrency, lm.num_cpus, lm.num_gpus, None if on_gpu else memory,
                        memory if on_gpu else None, detail=size.describe(), fix="lower zerorag.lm_pruner.concurrency")
        more = self._more("zerorag.lm_pruner")
        if on_gpu and n and size.params:  # a forward pass over each `title: sentence` (no chat template), as an encoder's
            seconds, how = encode_seconds(self.timing.gpu, size.params, n, item.row_tokens, lm.num_gpus,
                                          lm.concurrency)
            stage = Stage(name, [bundle], work, seconds, how, more_gpus=more)
            stage.add_source("estimate", seconds)
            return stage
        if on_gpu or not n:
            return Stage(name, [bundle], work, how=f"no measured rate: {n or 0:,} sentences "
                         "predicted on GPUs" if on_gpu else "corpus size unknown", more_gpus=more)
        per_actor, how = scaled_rate("predict_lm", size, threads_of(lm.num_cpus, lm.threads))
        seconds = n / (per_actor * lm.concurrency) if per_actor else None
        return Stage(name, [bundle], work, seconds, f"{n:,} / ({how} x {lm.concurrency} actors)",
                     rates=("predict_lm",), more_gpus=more)

    def pruning(self, name: str, item: AddVectors) -> Stage:
        n, kept = item.pruned_from, item.vectors
        if not n or kept is None:
            return Stage(name, [], "corpus size unknown")
        sizing = self._size(kept, name)
        rate = RATES["prune"]
        at_once = self._parallel(max(1, math.ceil(n / self.c.zerorag.checkpoint_rows)))
        # the pruned index is the trained one without the dropped ids (`index.prune`): no k-means, CPU tasks only
        tasks = [b for b in sizing.bundles if b.what != "index train task"] if sizing else []
        stage = Stage(name, tasks, f"{n:,} sentences -> {kept:,} kept",
                      n / (rate.value * at_once), f"{n:,} / ({rate.value:,g} per CPU-second [prune] x {at_once:g} CPUs)",
                      notes=[f"pruned index: {sizing.describe()}; its quantizer is the full index's (no k-means)"]
                      if sizing else [], rates=("prune",))
        stage.add_source("benchmark", stage.seconds)
        return stage

    def search(self, item: Search) -> Stage:
        q = item.queries
        return Stage(item.title, self._retrieval(), item.describe,
                     search_time(q, self.sizing, self.c.retrieval) if self.sizing else None,
                     "CPU search rate [search] x the search actors' CPUs" if q else "questions not counted",
                     rates=("search",) if q else (), more_gpus=RETRIEVAL_GPUS)

    PRICE = {ReadCorpus: ingest, Embed: embed, AddVectors: add_vectors, Generate: generate, Train: train,
             Predict: prediction}
