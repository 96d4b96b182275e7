"""The stages `wbrag run` would run for a config, in its order (`api.run`), each planned by `stages`' rules:
ingest -> embed -> index -> [write-back training] -> [Zero-RAG: mastery, pruners, prediction, every ratio, tuning,
router, the evaluation grid] -> [evaluation, base then base + write-back, when Zero-RAG is off].

Generator calls per question are upper bounds where a method decides at run time (FLARE retrieving for every
sentence, Self-RAG retrieving for every question); write-back's document gate and distiller run for the share
of examples the utility gate keeps (a measured selection rate); the Zero-RAG grid's router cells reuse their
twins' answers (the passes' answer memo). Each stage's time comes from `timing` (calibrated, benchmark or
estimate) and says which.

Over 400 lines: one builder walks a config's stages in run order, a method a stage, and reads best top to bottom
in one file; the rules it applies live in `stages` (bundles, index sizing) and `timing` (rates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from wbrag_ray import prompts
from wbrag_ray.config import ConfigError, GeneratorConfig, WbragConfig
from wbrag_ray.plan.accelerators import (
    DEFAULT_GPU,
    DEFAULT_INTERCONNECT,
    STORAGE_READ_GBS,
    Accelerator,
    Interconnect,
    accelerator,
    encode_seconds,
    interconnect,
    kmeans_seconds,
)
from wbrag_ray.plan.calibrate import training_dtype
from wbrag_ray.plan.corpus import CorpusSize, corpus_size, question_count
from wbrag_ray.plan.models import embedding_dim, model_size, serving_gb
from wbrag_ray.plan.placement import Bundle, Cluster, problems
from wbrag_ray.plan.rates import RATES
from wbrag_ray.plan.stages import (
    IndexSizing,
    Stage,
    embedder_bundle,
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
from wbrag_ray.plan.timing import EMBED_PASS, Timing, describe_record
from wbrag_ray.plan.tokens import TokenShape, template_of, token_shape

DIM_ASSUMED = 768
# an OpenAI-compatible endpoint: its rate is the provider's; assumed, and labeled an estimate
ENDPOINT_LATENCY_S = 0.5  # a request's time to its first token
ENDPOINT_TOKENS_PER_S = 60.0  # output tokens a second of one request
ANSWER_TOKENS = 4  # a short gold answer (NQ, TriviaQA), a tuning row's target
HEAD_SECONDS = 5.0  # the embedding pruner's head: a regression on a few thousand stored vectors, in the driver
TRAIN_START = RATES["train_start"].value


@dataclass(frozen=True)
class Pass:
    """Generator calls a question (or a sentence) makes in one kind of prompt: `docs` documents of `doc_tokens`
    (a corpus passage by default), up to `new_tokens` (default: generator.max_new_tokens); `mixture`: RePlug's
    group of `docs` one-document prompts decoded as one answer; `template`: the tokens of the prompt's instruction,
    solved examples and chat markers, where it is not the RAG or closed-book prompt (`template_of`); `question`:
    the tokens of what it asks about, where that is not the run's question (a sentence)."""

    calls: float
    docs: int
    new_tokens: int | None = None
    mixture: bool = False
    doc_tokens: float | None = None
    template: float | None = None
    question: float | None = None
    kind: str | None = None  # a prompt kind `--calibrate` times on the config's own data (write-back's distiller)


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
    `gpu`: the accelerator GPU stages without a rate are estimated for (`accelerators.ACCELERATORS`); `records`:
    calibration records (`calibrate.load_records`) whose hardware a stage's may match; `network`: the
    interconnect between nodes (`accelerators.INTERCONNECTS`); `storage_gbs`: a node's read rate of model files."""
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

    def __init__(self, config: WbragConfig, cluster: Cluster, corpus: CorpusSize, timing: Timing):
        self.c, self.cluster, self.corpus, self.timing = config, cluster, corpus, timing
        self.refusals: list[str] = []
        self.warnings: list[str] = []
        dim, self.dim_source = embedding_dim(config.embedder.model, model_size(config.embedder.model))
        self.dim = dim or DIM_ASSUMED
        if dim is None:
            self.dim_source = f"{DIM_ASSUMED} assumed"
            self.warnings.append(f"embedder {config.embedder.model}: vector dimension unknown, {DIM_ASSUMED} assumed")
        self.units = corpus.units(config.index.unit)
        self.sizing = self._size(self.units, "index") if self.units else None
        self.nodes = [{"CPU": n.cpus, "GPU": n.gpus} for n in cluster.nodes]
        self.shares = False  # retrieval's actors as shares of the replicas' GPUs (`gpu_layout`)
        self._decide_gpu_layout()
        # search actors and query embedders on GPUs of their own (shares beside the replicas hold no whole GPU)
        self.held = 0.0 if self.shares else sum(b.count * b.gpus for b in self._retrieval())
        self.auto: set[str] = set()
        self._decide_auto_concurrency()

    def _decide_gpu_layout(self) -> None:
        """The "auto" GPU settings as a command would decide them on this cluster (`gpu_layout.apply_gpu_layout`,
        the commands' own rule): the generator's tensor-parallel size, retrieval's whole GPUs or shares beside the
        replicas. The faiss of a GPU cluster is assumed to have GPU support (the project's image installs it)."""
        from wbrag_ray.cluster_nodes import needs_layout
        from wbrag_ray.gpu_layout import apply_gpu_layout, holds_whole_gpus, index_on_gpu

        if not needs_layout(self.c):
            return
        self.c = self.c.model_copy(deep=True)  # the caller's config keeps its "auto"
        try:
            on_gpu = index_on_gpu(self.c.index.gpu, self.cluster.gpus, self.cluster.gpus > 0)
            search = ((self.sizing.groups * self.c.retrieval.concurrency, self.sizing.group_gb * 1e9)
                      if on_gpu and self.sizing else (0, 0.0))
            said, layout = apply_gpu_layout(self.c, self.nodes, search, self.cluster.gpu_memory_gb)
        except ConfigError as exc:
            self.refusals.append(str(exc))
            g = self.c.generator
            if g.tensor_parallel_size == "auto":  # refused: planned at the largest size a node has, to show the rest
                size = model_size(g.model)
                most = int(max((n.gpus for n in self.cluster.nodes), default=1) or 1)
                g.num_gpus = float(max(size.tensor_parallel_sizes(most)) * g.pipeline_parallel_size)
                g.tensor_parallel_size = int(g.num_gpus) // g.pipeline_parallel_size
            return
        self.shares = not holds_whole_gpus(layout)
        self.warnings += said

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
        shape = self.timing.shape
        tokens = shape.passage if unit == "passage" else self._sentence_tokens()
        seconds, how, source = self.timing.embedding(e, n, tokens, e.concurrency)
        if seconds is not None:
            stage = Stage("embed", [bundle], work, seconds, how, more_gpus=more, notes=[f"tokens: {shape.source}"])
            stage.add_source(source, seconds)
            self._start(stage, "embedder", e.model, e.num_gpus, e.dtype, threads_of(e.num_cpus, e.threads),
                        service=EMBED_PASS, actors=e.concurrency)
            return stage
        if e.num_gpus > 0:
            return Stage("embed", [bundle], work, how=f"{e.model}: size unknown, no estimate", more_gpus=more)
        per_actor, how = scaled_rate("embed", model_size(e.model), threads_of(e.num_cpus, e.threads))
        if per_actor is None:
            return Stage("embed", [bundle], work, how=how)
        if unit == "passage":  # the rate is of sentences; a passage is about this many sentences of tokens
            per_actor /= RATES["sentences_per_passage"].value
            how += f" / {RATES['sentences_per_passage'].value} sentences a passage"
        return Stage("embed", [bundle], work, n / (per_actor * e.concurrency),
                     f"{n:,} / ({how} x {e.concurrency} actors)", more_gpus=more,
                     rates=("embed",) + (("sentences_per_passage",) if unit == "passage" else ()))

    def _sentence_tokens(self) -> float:
        """A sentence's tokens: the passage's over the run's sentences a passage where the ingest counted them."""
        c = self.corpus
        if c.passages and c.sentences and not c.rates:
            return self.timing.shape.passage * c.passages / c.sentences
        return self.timing.shape.sentence

    def index(self) -> Stage:
        s, n = self.sizing, self.units
        if s is None or not n:
            return Stage("index", [], "corpus size unknown" if not n else "refused by the sizing rules")
        seconds, how, keys, left_out = index_time(s, n, self.dim, self.cluster.cpus)
        stage = Stage("index", list(s.bundles), f"{n:,} vectors of {self.dim} dimensions ({self.dim_source})",
                      seconds, how, rates=keys,
                      more_gpus=KMEANS_GPU,
                      notes=[s.describe(), f"retrieval service: {s.groups} search actor group(s) of up to "
                             f"{s.group_gb:,.3g} GB (retrieval.actor_memory_gb={self.c.retrieval.actor_memory_gb})"])
        stage.add_source("benchmark", seconds)
        if left_out:  # k-means on a GPU: from its FLOPs
            self._kmeans_on_gpu(stage, s)
        ic = self.c.index
        if ic.target_recall is not None and ("IVF" in s.factory or "HNSW" in s.factory):
            # index.recall: an exact search of the sample over every vector, one more read of the embeddings
            flops = 2.0 * ic.recall_queries * n * self.dim
            stage.notes.append(f"search setting measured to recall@10 {ic.target_recall:g} of exact search: "
                               f"{ic.recall_queries} exact searches over every vector ({flops:.2g} FLOPs, a task "
                               "per embedding shard), then a few searches of them per shard")
        return stage

    # --- model passes --------------------------------------------------------------------------------------

    def _passes(self, method: str) -> list[Pass]:
        """The generator passes a method makes per question, at most: (calls, documents a prompt, new tokens,
        mixture). Self-RAG: its retrieval judgement, a relevance judgement per document (one token each) and the
        answer; FLARE: a look-ahead and a rewrite with documents per round, each decoding rag.flare's
        look_ahead_tokens; RePlug on a backend that decodes mixtures: one group of K one-document prompts."""
        k, rounds, doc = self.c.retrieval.top_k, self.c.rag.flare.max_rounds, self._doc_tokens
        look = self.c.rag.flare.look_ahead_tokens  # both FLARE passes decode its look-ahead (`rag.flare`)
        replug = ([Pass(1, k, mixture=True, doc_tokens=doc)] if self.c.generator.backend == "hf"
                  else [Pass(k, 1, doc_tokens=doc)])
        judge = template_of(lambda q, _: prompts.retrieval_judge_messages(q))  # few-shot, as the relevance judge
        return {"no-retrieval": [Pass(1, 0)], "naive": [Pass(1, k, doc_tokens=doc)], "replug": replug,
                "replug-vote": [Pass(k, 1, doc_tokens=doc)],
                "self-rag": [Pass(1, 0, 1, template=judge), Pass(k, 1, 1, doc_tokens=doc, template=self._relevance_template),
                             Pass(1, k, doc_tokens=doc)],
                "flare": [Pass(rounds, 0, look), Pass(rounds, k, look, doc_tokens=doc)]}[method]

    @property
    def _doc_tokens(self) -> float:
        """A retrieved document's tokens: the index unit's (a passage, or a sentence of Zero-RAG's index)."""
        return self.timing.shape.passage if self.c.index.unit == "passage" else self._sentence_tokens()

    @property
    def _relevance_template(self) -> float:
        """Self-RAG's relevance judgement of one document (WriteBack-RAG's document gate): few-shot."""
        return template_of(lambda q, d: prompts.relevance_judge_messages(q, d[0]), 1)

    def _method_passes(self, methods: list[str]) -> list[Pass]:
        return [p for m in methods for p in self._passes(m)]

    def _retrieval(self) -> list[Bundle]:
        if self.sizing is None:
            return []
        c = self.c
        return retrieval_bundles(self.sizing, c.index, c.retrieval, c.embedder, self.cluster)

    def _model_stage(self, name: str, g: GeneratorConfig, questions: int | None, passes: list[Pass], work: str,
                     retrieval: bool, key: str = "generator", kinds: dict | None = None) -> Stage:
        """A stage of generator passes: `questions` x each pass's calls on the service of `g`, beside the
        retrieval service when it searches; the services' start where this is the first stage to ask for them.
        `kinds`: a calibration record whose prompt kinds (points) time the passes of that kind."""
        bundles, notes, refusals = generator_bundles(g, key, self.cluster)
        stage = Stage(name, bundles + (self._retrieval() if retrieval else []), work, 0.0, notes=notes,
                      refusals=refusals, more_gpus=self._more(key))
        if questions is None:
            stage.seconds, stage.how = None, "questions not counted: no time"
            return stage
        self._start(stage, "generator", g.model, g.num_gpus, g.dtype, threads_of(g.num_cpus, g.threads), g.backend,
                    actors=g.concurrency)
        if retrieval:
            e = self.c.retrieval.query_embedder(self.c.embedder)
            self._start(stage, "embedder", e.model, e.num_gpus, e.dtype, threads_of(e.num_cpus, e.threads),
                        service="query embedder", actors=self.c.retrieval.concurrency)
        for p in passes:
            self._add_time(stage, g, round(questions * p.calls), p, kinds=kinds)
        return stage

    def _services_end(self) -> None:
        """After a Ray Train stage: its workers took the CPUs (or GPUs) the services held, and a kept service ends
        once idle for ray.keep_services_s anyway (`stages.kept`), far less than a training: the next stage to
        generate or embed queries starts its services again."""
        self.timing.started.clear()

    def _start(self, stage: Stage, role: str, model: str, num_gpus: float, dtype: str, threads: int,
               backend: str | None = None, service: str | None = None, actors: int = 1) -> None:
        """Add a service's start (its `actors`, spread over the cluster's nodes, loading the model at once)."""
        per_node = max(1, math.ceil(actors / max(1, len(self.cluster.nodes))))
        seconds, how, source = self.timing.service_start(role, model, num_gpus, dtype, threads, backend, service,
                                                         actors, per_node)
        if seconds:
            stage.seconds = None if stage.seconds is None else stage.seconds + seconds
            stage.how = f"{stage.how}; {how}" if stage.how else how
            stage.add_source(source, seconds)

    def _add_time(self, stage: Stage, g: GeneratorConfig, calls: int | None, p: Pass, label: str = "",
                  kinds: dict | None = None) -> None:
        if calls is None:
            seconds, how, source = None, "questions not counted: no time", None
        elif g.backend == "openai":  # the endpoint's own rate: a stated latency and output speed, per request
            per_call = ENDPOINT_LATENCY_S + (p.new_tokens or g.max_new_tokens) / ENDPOINT_TOKENS_PER_S
            seconds, source = calls * per_call / max(1, g.concurrency), "estimate"
            how = (f"estimate: {calls:,} calls to the endpoint x ({ENDPOINT_LATENCY_S:g} s + {p.new_tokens or g.max_new_tokens}"
                   f" tokens at {ENDPOINT_TOKENS_PER_S:g}/s) / {g.concurrency} in flight")
        else:
            point = next((pt for pt in (kinds or {}).get("points", []) if pt["shape"] == p.kind), None)
            seconds, how, source = self.timing.generation(g, calls, p.docs, p.new_tokens, p.doc_tokens, p.mixture,
                                                          p.template, p.question, point)
        stage.seconds = None if seconds is None or stage.seconds is None else stage.seconds + seconds
        stage.how = f"{stage.how}; {label}{how}" if stage.how else label + how
        stage.add_source(source, seconds)
        if source == "benchmark":
            stage.rates += ("closed_book",) if p.docs == 0 and not p.mixture else (f"rag_prompt_{g.backend}",)

    def writeback(self) -> Stage:
        """s_nr and s_rag for every training question; for the share the utility gate keeps, the document gate's
        answer from each of the K documents alone (none for replug-vote, whose slots are those answers), the
        distiller's extraction from the retained documents and its rewrite. The keep rate, retained documents and
        the distiller's calls are measured on the config's own data where calibrated (`selection`), else the
        paper's stated figures for its dataset, else the demo's, each said so."""
        wb, k, g = self.c.writeback, self.c.retrieval.top_k, self.c.generator
        q, counted = question_count(wb.train, wb.limit)
        measured = self.timing.writeback_record(g, wb.train, k)
        kept, retained, why = self._keep_rate(measured)
        extract = Pass(kept, round(retained), wb.extract_max_new_tokens, doc_tokens=self._doc_tokens,
                       template=template_of(prompts.extract_messages, round(retained)), kind="extract")
        rewrite = Pass(kept, 1, wb.rewrite_max_new_tokens, doc_tokens=wb.extract_max_new_tokens,
                       template=template_of(lambda q, _: prompts.rewrite_messages(q, "")), kind="rewrite")
        # the document gate answers each document alone, in the RAG prompt (`rag.expand`'s replug-vote rows)
        gate = [] if wb.rag_method == "replug-vote" else [Pass(k * kept, 1, doc_tokens=self._doc_tokens,
                                                                 kind="document gate")]
        passes = [Pass(1, 0), *self._passes(wb.rag_method), *gate, extract, rewrite]
        calls = sum(p.calls for p in passes)
        total = f", {q * calls:,.0f} in all" if q else ""
        stage = self._model_stage("write-back training", g, q, passes,
                                  f"questions: {counted}; about {calls:.3g} generator calls each{total} (s_nr, "
                                  f"{wb.rag_method} s_rag; for the {kept:.1%} the utility gate keeps ({why}): "
                                  f"the document gate over K={k}, extract from {retained:.2g} retained documents, "
                                  "rewrite)", True, kinds=measured)
        if measured is None:
            stage.rates += ("writeback_selection",) if "demo" in why else ("writeback_selection_nq",)
        else:
            first = sum(max(0.0, pt.get("first_use_seconds", 0.0)) for pt in measured["points"])
            stage.seconds = None if stage.seconds is None else stage.seconds + first
            stage.how += f"; the distiller's prompt shapes' first use {first:.0f} s [calibrated]"
            stage.add_source("calibrated", first)
        paper = RATES["writeback_calls_nq"]
        if measured is None and "paper" in why and q:
            stage.notes.append(f"the paper states about {paper.value:,.0f} generator calls for NQ's training set "
                               f"[writeback_calls_nq] (its distiller one call a kept example); this plan counts "
                               f"{q * calls:,.0f} (extraction and rewrite two calls, as `writeback.distill` runs)")
            stage.rates += ("writeback_calls_nq",)
        stage.notes.append(f"the units are embedded with the embedder's actors and indexed ({wb.index_factory})")
        return stage

    def _keep_rate(self, measured: dict | None) -> tuple[float, float, str]:
        """(the utility gate's keep rate, documents the document gate retains, where they come from)."""
        wb, k = self.c.writeback, self.c.retrieval.top_k
        if measured is not None:
            lo, hi = measured["keep_interval"]
            return (measured["keep_rate"], measured["retained_docs"],
                    f"{measured['kept']} of {measured['questions']} sampled, 95% interval {lo:.0%}-{hi:.0%} "
                    "[calibrated]")
        from wbrag_ray.formats import dataset_name

        if dataset_name(wb.train) == "nq" and "train" in wb.train.rsplit("/", 1)[-1] and k == 5:
            return (RATES["writeback_selection_nq"].value, k,
                    "the paper's NQ figure [writeback_selection_nq]; assumed: `wbrag plan --calibrate` measures it "
                    "where the training set is local; retained documents assumed K")
        self.warnings.append("write-back: the utility gate's keep rate is the demo's "
                             f"{RATES['writeback_selection'].value:.1%} [writeback_selection], and the distiller's "
                             "calls are timed at their max_new_tokens: `wbrag plan CONFIG --calibrate` measures them "
                             "on this config's own training questions and corpus")
        return RATES["writeback_selection"].value, k, "the demo's [writeback_selection], assumed; retained K assumed"

    def evaluation(self, writeback: bool) -> Stage:
        ev = self.c.eval
        q, counted = question_count(ev.dataset, ev.limit)
        passes = self._method_passes(ev.methods)
        name = "evaluation" + (" with write-back" if writeback else "")
        extra = self._appended_units() if writeback else 0
        k = self.c.retrieval.top_k
        if extra:  # the prompts that read the top K read its units too
            passes = [replace(p, docs=p.docs + extra) if p.docs == k and not p.mixture else p for p in passes]
        return self._model_stage(name, self.c.generator, q, passes, f"questions: {counted}; methods "
                                 f"{', '.join(ev.methods)}: up to {sum(p.calls for p in passes):g} calls a question"
                                 + (f"; the additive union: up to {k} + {extra} documents a prompt" if extra else ""),
                                 any(m != "no-retrieval" for m in ev.methods))

    def _appended_units(self) -> int:
        """Units `retrieval.union: additive` appends after the base's K, so a prompt beside a write-back index holds
        up to K + these documents. Under `auto` a version chooses its rule at its validation, after any plan: K
        documents are counted, as every other rule gives."""
        from wbrag_ray.retrieval.union import ADDITIVE_UNITS, UNIONS

        r = self.c.retrieval
        if r.union not in UNIONS or not UNIONS[r.union].additive:
            return 0
        return ADDITIVE_UNITS if r.max_units is None else r.max_units

    # --- Zero-RAG ----------------------------------------------------------------------------------------

    def zero_rag(self) -> list[Stage]:
        c, z = self.c, self.c.zerorag
        out = [self.mastery()]
        for kind in dict.fromkeys([*z.train_pruners, z.pruner]):
            out.append(self.pruner_training(kind))
            if kind == "lm":
                self._services_end()
        out.append(self.prediction())
        out += [self.pruning(r) for r in z.ratios if r > 0]
        q, counted = question_count(z.train, z.train_limit)
        if z.tune.enabled:
            out += self.tuning(q, counted)
            self._services_end()
        if z.router:
            router = self._model_stage("router", c.generator, q, [Pass(1, 0)], f"training questions: {counted}; one "
                                       "closed-book answer each (labels), their embeddings from the query embedder",
                                       False)
            e = c.retrieval.query_embedder(c.embedder)
            self._start(router, "embedder", e.model, e.num_gpus, e.dtype, threads_of(e.num_cpus, e.threads),
                        service="query embedder", actors=c.retrieval.concurrency)
            out.append(router)
        if c.eval.dataset:
            n, counted = question_count(c.eval.dataset, c.eval.limit)
            adapters, writebacks = (2 if z.tune.enabled else 1), (2 if c.writeback.train else 1)
            cells = len({0.0, *z.ratios}) * (2 if z.router else 1) * adapters * writebacks
            # what the grid generates: no-retrieval once per adapter (no index), the other methods in every cell of
            # ratio x write-back x adapter; a router cell's prompts are its no-router twin's or the closed-book ones,
            # which the passes' answer memo reuses
            passes = [replace(p, calls=p.calls * adapters * (1 if m == "no-retrieval" else len({0.0, *z.ratios}) * writebacks))
                      for m in c.eval.methods for p in self._passes(m)]
            out.append(self._model_stage("evaluation grid", c.generator, n, passes,
                                         f"questions: {counted}; {cells} settings (ratios x router x adapter x "
                                         f"write-back), up to {sum(p.calls for p in passes):g} calls a question "
                                         "(the router's cells reuse their twins' answers)", True))
        return out

    def _own_answers(self, training: Stage, q: int | None) -> Stage:
        """`zerorag.tune.targets: own`: the generator answers each training row (relevant and distracting
        documents, none) before the training, in the same run stage: its time is added to the training's."""
        t, g = self.c.zerorag.tune, self.c.generator
        if t.targets != "own":
            return training
        k = t.docs_per_format or self.c.retrieval.top_k
        own = self._model_stage("own answers", g, q, [Pass(2, k, doc_tokens=self._doc_tokens), Pass(1, 0)], "", False)
        # the generator's actors end before the training's workers start: the stage's bundles stay the training's
        training.work += "; first the generator answers each row, its right answers kept as targets"
        training.rates += tuple(r for r in own.rates if r not in training.rates)
        training.seconds = None if own.seconds is None or training.seconds is None else own.seconds + training.seconds
        training.how = f"own answers: {own.how}; then {training.how}"
        for source, seconds in own.sources.items():
            training.add_source(source, seconds)
        return training

    def mastery(self) -> Stage:
        z, g = self.c.zerorag, self.c.generator
        sample = min(z.sample, self.corpus.sentences or z.sample)
        if z.qa_mode == "llm":
            answers, written = sample * z.qa_per_sentence, sample
        else:
            answers, written = round(sample * z.qa_per_sentence * RATES["cloze_calls_per_pair"].value), 0
        # a cloze answer's prompt is few-shot (its instruction and three solved examples, then the blanked
        # sentence): about twice a closed-book question's tokens
        cloze = z.qa_mode == "cloze"
        answer = Pass(1, 0, z.answer_max_new_tokens, template=template_of(
            lambda q, _: prompts.closed_book_messages(q, cloze=True)) if cloze else None,
            question=self.timing.shape.sentence if cloze else None)
        stage = self._model_stage("mastery", g, answers, [answer], f"{sample:,} sentences: {written:,} QA-writing "
                                  f"calls, {answers:,} closed-book answers", False)
        if written:  # the QA writer's prompts hold the sentence and its answers run long: the RAG-prompt rate
            writer = z.qa_generator or g
            if writer is not g and (writer.backend == "openai" or not writer.num_gpus) and stage.seconds is not None:
                # the generator's GPUs are held for the answer pass only: the writer's API (or CPU) pass runs first
                stage.held_seconds = stage.seconds
                stage.notes.append(f"the generator's GPUs are held for the answer pass only ({stage.seconds:,.0f} s; "
                                   "the QA pairs are written first, without them)")
            if z.qa_generator is not None:
                bundles, notes, refusals = generator_bundles(writer, "zerorag.qa_generator", self.cluster)
                stage.bundles += bundles
                stage.notes += notes
                stage.refusals += refusals
            self._start(stage, "generator", writer.model, writer.num_gpus, writer.dtype,
                        threads_of(writer.num_cpus, writer.threads), writer.backend)
            template = template_of(lambda q, _: prompts.qa_write_messages(q, z.qa_per_sentence, writer.chat_template))
            self._add_time(stage, writer, written, Pass(1, 0, z.qa_max_new_tokens, template=template,
                                                        question=self.timing.shape.sentence), "QA writing: ")
        return stage

    def pruner_training(self, kind: str) -> Stage:
        z = self.c.zerorag
        fit = max(1, round(z.sample * (1 - z.val_fraction)))
        if kind == "embedding":  # a small regression head fit in the driver: reading the sample's vectors, seconds
            return Stage("pruner training (embedding head)", [], f"a head on {fit:,} stored vectors, in the driver",
                         HEAD_SECONDS, f"small: about {HEAD_SECONDS:g} s (a head on stored vectors)")
        lm = z.lm_pruner
        # its rows are `title: sentence`, no chat template (`zerorag.prune`), cut at max_length
        row = min(lm.max_length, self.timing.shape.title + 1 + self._sentence_tokens())
        return self._training("pruner training (LM regressor)", lm.backbone, lm, fit, "zerorag.lm_pruner", row,
                              f"rows of `title: sentence`, {row:,.0f} tokens")

    def _training(self, name: str, model: str, section, examples: int, key: str, row_tokens: float,
                  rows: str) -> Stage:
        """A Ray Train stage of `examples` rows of `row_tokens` each as the trainer pads them (`rows`: what they
        are): its compute, on GPUs its collectives and the model's load, and Ray Train's start."""
        from wbrag_ray.training.workers import plan_steps

        trainer = section.trainer
        bundles, warn = training_bundles(model, trainer, f"{key}.trainer", self.cluster.gpu_memory_gb,
                                         self.timing.gpus_per_node)
        self.warnings += [warn] if warn else []
        more = self._more(f"{key}.trainer")
        try:
            steps, batch = plan_steps(section, examples, trainer.num_workers)
        except (ConfigError, ValueError) as exc:
            return Stage(name, bundles, f"{examples:,} examples", refusals=[f"{name}: {exc}"], more_gpus=more)
        seconds, how, source, parts = self.timing.training(model, trainer, section.threads, steps, batch, row_tokens,
                                                           self.c.generator.model, section)
        keys: tuple = ()
        if seconds is None:
            seconds, how, keys = training_time(model, trainer, steps, batch, row_tokens)
            source = "benchmark" if keys else None
        capped = f", capped by {key}.max_steps" if section.max_steps and steps == section.max_steps else ""
        stage = Stage(name, bundles, f"{examples:,} examples: {steps:,} steps of {batch}{capped}, "
                      f"{trainer.num_workers} worker(s); {rows}: {steps * batch * row_tokens:,.0f} tokens",
                      seconds, how, rates=keys, more_gpus=more)
        stage.add_source(source, seconds)
        if seconds is None:
            return stage
        # Ray Train's controller, worker group and process group, measured where calibrated; the model's load is
        # the calibrated worker's (measured), or in the estimate already
        rec = self.timing.record("training", self.c.generator.model, trainer.num_gpus,
                                 training_dtype(trainer.num_gpus), threads_of(trainer.num_cpus, section.threads))
        measured = (rec or {}).get("train_start_seconds") if source == "calibrated" else None
        train_start = TRAIN_START if measured is None else measured
        load = (rec or {}).get("load_seconds", 0.0) if source == "calibrated" else 0.0
        stage.seconds += train_start + load
        stage.how += (f"; Ray Train start {train_start:.0f} s {'[train_start]' if measured is None else '[calibrated]'}"
                      + (f" + model load {load:.0f} s" if source == "calibrated" else ""))
        if measured is None:
            stage.rates += ("train_start",)
        stage.add_source("benchmark" if measured is None else "calibrated", train_start)
        if len(parts) > 1:  # the estimate's parts, each on its own line of the plan
            stage.notes.append("time by part: " + ", ".join(f"{k} {v:,.0f} s" for k, v in parts.items())
                               + f", Ray Train start {train_start:.0f} s")
        return stage

    def _tuning_row_tokens(self) -> tuple[float, str]:
        """A tuning step's rows as the trainer pads them: relevant and distracting rows hold docs_per_format
        documents (the index unit's), the retrieval-free row none; each worker pads to its longest row and the
        step waits for the slowest, so a step costs its longest row, nearly always a row with documents (all
        `batch` rows without: 1 in 3^batch), each at most max_length."""
        t, g = self.c.zerorag.tune, self.c.generator
        d = t.docs_per_format or self.c.retrieval.top_k
        answer = (g.max_new_tokens if t.targets == "own" else ANSWER_TOKENS) + 1  # the answer and its end token
        with_docs = min(t.max_length, self.timing.shape.prompt(d, self._doc_tokens) + answer)
        without = min(t.max_length, self.timing.shape.prompt(0) + answer)
        none_only = (1 / 3) ** max(1, min(t.batch_size, 64))
        padded = with_docs * (1 - none_only) + without * none_only
        return padded, (f"rows of {with_docs:,.0f} tokens ({d} documents) and {without:,.0f} (none), a step at its "
                        f"longest")

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
        if on_gpu and n and size.params:  # a forward pass over each `title: sentence` (no chat template), as an encoder's
            tokens = min(lm.max_length, self.timing.shape.title + 1 + self._sentence_tokens())
            seconds, how = encode_seconds(self.timing.gpu, size.params, n, tokens, lm.num_gpus, lm.concurrency)
            stage = Stage("prediction (LM pruner)", [bundle], work, seconds, how, more_gpus=more)
            stage.add_source("estimate", seconds)
            return stage
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
        # the pruned index is the trained one without the dropped ids (`index.prune`): no k-means, CPU tasks only
        tasks = [b for b in sizing.bundles if b.what != "index train task"] if sizing else []
        stage = Stage(name, tasks, f"{n:,} sentences -> {kept:,} kept",
                      n / (rate.value * at_once), f"{n:,} / ({rate.value:,g} per CPU-second [prune] x {at_once:g} CPUs)",
                      notes=[f"pruned index: {sizing.describe()}; its quantizer is the full index's (no k-means)"]
                      if sizing else [], rates=("prune",))
        stage.add_source("benchmark", stage.seconds)
        return stage

    def _kmeans_on_gpu(self, stage: Stage, sizing: IndexSizing) -> None:
        """An index train task's k-means on one GPU, added to `stage` from its FLOPs (no GPU rate measured)."""
        kmeans, why = kmeans_seconds(self.timing.gpu, sizing.train_sample, sizing.nlist, self.dim)
        stage.seconds += kmeans
        stage.how = stage.how.replace("; k-means on a GPU: no measured rate", "") + f"; {why}"
        stage.task_gpu_seconds = kmeans
        stage.add_source("estimate", kmeans)

    def tuning(self, q: int | None, counted: str) -> list[Stage]:
        t, g = self.c.zerorag.tune, self.c.generator
        retrieve = Stage("tuning: retrieval", self._retrieval(), f"training questions: {counted}; top "
                         f"{max(t.retrieve_k, self.c.retrieval.top_k)} each",
                         search_time(q, self.sizing, self.c.retrieval) if self.sizing else None,
                         "CPU search rate [search] x the search actors' CPUs" if q else "questions not counted",
                         rates=("search",) if q else (), more_gpus=RETRIEVAL_GPUS)
        row, rows = self._tuning_row_tokens()
        if q:  # relevant, distracting and no documents: at most three rows a question
            return [retrieve, self._own_answers(self._training("tuning: LoRA training", g.model, t, 3 * q,
                                                               "zerorag.tune", row, rows), q)]
        if t.max_steps:  # uncounted, but the cap bounds it: as many examples as max_steps full batches take
            stage = self._training("tuning: LoRA training", g.model, t, t.max_steps * t.batch_size, "zerorag.tune",
                                   row, rows)
            stage.work = f"questions not counted: at most {stage.work.split(': ', 1)[-1]}"
            return [retrieve, self._own_answers(stage, None)]
        bundles, warn = training_bundles(g.model, t.trainer, "zerorag.tune.trainer", self.cluster.gpu_memory_gb,
                                         self.timing.gpus_per_node)
        self.warnings += [warn] if warn else []
        return [retrieve, Stage("tuning: LoRA training", bundles, f"questions not counted: {t.epochs:g} epoch(s) "
                                f"over up to 3 rows a question, {t.batch_size} a step", how="no time",
                                more_gpus=self._more("zerorag.tune.trainer"))]
