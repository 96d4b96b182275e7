"""Typed configuration: one model for a whole run, loaded from YAML plus `--set key=value` overrides, validated
once before any stage starts; every error names the dotted key and the fix. Every field says what it sets; the
guide (docs/guide.md) says how the settings work together.

Over 700 lines, not split: it is the one config reference a user reads, every field with its description."""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

BUNDLED_GENERATOR = "bundled:smollm2"
BUNDLED_EMBEDDER = "bundled:all-minilm-l6-v2"


class ConfigError(ValueError):
    """A configuration problem, already phrased for a person: the key, the problem, the fix."""


def _concurrency(value: Any) -> Any:
    if value == "auto":
        return value
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or isinstance(value, bool) or (isinstance(value, float) and value != count):
        raise ValueError(f"must be a positive integer or 'auto', not {value!r}")
    return count


# A count: a positive integer, or "auto" (actors, training workers: decided by each command as it joins Ray;
# nprobe, index shards: by the index build).
PositiveOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_concurrency)]
AUTO_CONCURRENCY = (" 'auto': as many as the cluster holds (an autoscaling cluster: its declared maximum), decided by "
                    "each command as it joins Ray (GPU actors: the GPUs, the generator's less those the index's search "
                    "actors and query embedders hold; CPU actors: the CPUs, less one for reads).")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Keys that never change what a stage writes: left out of stage fingerprints.
    RUNTIME_KEYS: ClassVar[frozenset[str]] = frozenset()


class RayConfig(_Section):
    address: str | None = Field(None, description="Ray cluster to join ('auto', 'ray://host:10001', host:port); "
                                "None starts a local one.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster (local clusters only).")
    pending_timeout_s: float = Field(1800.0, gt=0, description="Seconds a service's actors may wait for a node with "
                                     "their resources before the command fails naming what is missing.")
    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of one GPU (sizes tensor_parallel_size auto "
                                        "and GPU shares); None: from the nodes' accelerator_type, else 80 GB (logged).")


class IngestConfig(_Section):
    corpus: str | None = Field(None, description="FlashRAG corpus: jsonl or Parquet file or folder, local or s3://.")
    shard_bytes: int = Field(64 << 20, ge=1024, description="Bytes of one ingest shard of a (huge) jsonl file.")
    max_passage_chars: int = Field(100_000, ge=16, description="Longer passages are rejected with a reason "
                                   "(protects segmentation and memory).")
    min_sentence_chars: int = Field(1, ge=1, description="Shorter sentences (stripped) are not kept as sentences.")


class EmbedderConfig(_Section):
    RUNTIME_KEYS = frozenset({"batch_size", "trust_remote_code"})

    model: str = Field(BUNDLED_EMBEDDER, description="sentence-transformers model: local folder, s3:// folder, hub "
                       "id or bundled:*.")
    batch_size: int = Field(64, ge=1, description="Sentences per forward pass.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype; 'auto': bf16 where the CPU or GPU supports it.")
    storage_dtype: Literal["float32", "float16"] = Field("float32", description="dtype of stored embedding shards.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per embed actor; below the node's CPUs, so reads can run.")
    threads: int | None = Field(None, ge=1, description="torch threads per embed actor (default: ceil(num_cpus) plus "
                                 "the node's CPUs nothing else computes on, measured before each batch).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per embed actor.")
    concurrency: PositiveOrAuto = Field(1, description="Number of embed actors." + AUTO_CONCURRENCY)
    max_seq_length: int | None = Field(None, ge=8, description="Truncate inputs to this many tokens.")
    query_prompt: str | None = Field(
        None, description="A prompt the model ships (sentence-transformers' `prompts`) put before queries only "
        "(s2p_query for stella_en_400M_v5). Unset: e5's 'query: ' / 'passage: ' prefixes, else none.")
    trust_remote_code: bool = Field(False, description="Run the model's own Python code (stella_en_400M_v5 ships its "
                                    "architecture as code): only for a model you trust.")
    checkpoint_rows: int = Field(20_000, ge=1, description="About this many vectors per written block (file and "
                                 "checkpoint commit): what a crash can cost per actor.")
    config_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the model's transformers config, e.g. "
        "{unpad_inputs: false}. Where xformers does not import, a model whose config asks for its attention or "
        "unpadding (stella_en_400M_v5) loads with both off, logged, unless set here.")


class GeneratorConfig(_Section):
    RUNTIME_KEYS = frozenset({"batch_size", "cache_dir", "api_key_env", "calls_per_engine", "pipeline_across_nodes",
                              "gpu_share"})

    backend: Literal["hf", "vllm", "openai"] = Field("hf", description="hf (transformers), vllm, or openai (HTTP).")
    model: str = Field(BUNDLED_GENERATOR, description="Local HF folder, s3:// folder (fetched once per node), GGUF "
                       "file, hub id, or bundled:smollm2.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="hf backend compute dtype; 'auto': bf16 where the hardware supports it.")
    max_new_tokens: int = Field(32, ge=1, description="Greedy decoding stops after this many tokens.")
    batch_size: int = Field(32, ge=1, description="Most prompts per generate call (hf: fewer where long prompts "
                            "would not fit memory_gb).")
    memory_gb: float | None = Field(None, gt=0, description="hf backend: memory one generate call may use for KV "
                                    "cache and activations. Default: 90% of the GPU memory left after loading; on CPU "
                                    "0.5 GiB (more rows a call are no faster there), within half the node's free memory.")
    stop: list[str] = Field(default_factory=lambda: ["\n"], description="Generation stops at the first of these "
                            "strings (cut off); passes that write several lines clear it.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs each generator actor asks Ray for.")
    threads: int | None = Field(None, ge=1, description="hf backend: torch threads per generator actor (default: "
                                 "ceil(num_cpus) plus the node's CPUs nothing else computes on, measured before each batch).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per generator actor (vllm: per engine replica).")
    tensor_parallel_size: int | Literal["auto"] | None = Field(
        None, description="vllm: GPUs of one node a replica's layers are sharded over (num_gpus 0: rank processes of "
        "vLLM's CPU build). Default: num_gpus / pipeline_parallel_size when num_gpus > 1, else 1. 'auto': the "
        "fewest GPUs that hold the weights and a KV cache for batch_size prompts; num_gpus then follows.")
    gpu_share: float = Field(1.0, gt=0, le=1, description="What each GPU of a multi-GPU replica asks Ray for "
                             "(VLLM_RAY_PER_WORKER_GPUS): 1, or less to leave room for retrieval's actors; set by "
                             "retrieval.search_gpus auto.")
    pipeline_parallel_size: int = Field(1, ge=1, description="vllm: stages a replica's layers are split into; "
                                        "num_gpus = tensor_parallel_size x pipeline_parallel_size (GPUs only).")
    pipeline_across_nodes: bool = Field(False, description="vllm: a replica's pipeline stages may sit on different "
                                        "nodes (PACK); off: the whole replica on one node (STRICT_PACK).")
    concurrency: PositiveOrAuto = Field(1, description="Number of generator actors / engine replicas." + AUTO_CONCURRENCY)
    calls_per_engine: int = Field(4, ge=1, description="vllm: batches one engine takes at once, so it decodes the "
                                  "next while the last one's longest answers finish (1: one call at a time).")
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template (instruct models).")
    batch_invariant: bool | Literal["auto"] = Field(
        "auto", description="A prompt's greedy answer does not depend on its batch. hf: prompts padded to 64-token "
        "length buckets, batched within one; vllm on GPUs: VLLM_BATCH_INVARIANT=1 (compute capability >= 8.0), which "
        "slows a tensor-parallel replica (NCCL on one channel). 'auto': on, off where tensor_parallel_size > 1.")
    checkpoint_rows: int = Field(1024, ge=1, description="Answers per committed block of a stage's answer checkpoint: "
                                 "what a killed pass can lose at most.")
    checkpoint_seconds: float = Field(60.0, gt=0, description="Answers decoded since the last block are committed "
                                      "after this many seconds, at the next finished batch.")
    cache_dir: str | None = Field(None, description="Where GGUF models are cached after de-quantization (default "
                                  "~/.cache/wbrag/converted).")
    base_url: str | None = Field(None, description="openai backend: the server's /v1 URL.")
    api_key_env: str = Field("OPENAI_API_KEY", description="openai backend: environment variable with the key.")
    lora_adapter: str | None = Field(None, description="LoRA adapter folder to apply (hf, vllm): a local path every "
                                     "node sees, or s3:// (fetched into each node's cache).")
    vllm_engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine arguments, merged "
                                               "over the throughput defaults.")

    def parallel_sizes(self) -> tuple[int, int]:
        """(tensor_parallel_size, pipeline_parallel_size) of one engine replica: as given, else tp = num_gpus / pp when
        num_gpus > 1, else 1; backends other than vllm run a model whole: (1, 1)."""
        if self.backend != "vllm":
            return 1, 1
        pp = self.pipeline_parallel_size
        if self.tensor_parallel_size == "auto":
            raise ConfigError("generator.tensor_parallel_size auto is decided on the cluster before the engine starts "
                              "(`placement.gpus.resolve_auto_concurrency`, `wbrag plan`); nothing decided it here")
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size, pp
        if self.num_gpus > 1:
            return max(1, int(self.num_gpus) // pp), pp
        return 1, pp

    def batch_invariance(self) -> bool | None:
        """generator.batch_invariant in effect: as set, else on unless a replica is tensor-parallel; None while
        tensor_parallel_size auto is undecided."""
        if self.batch_invariant != "auto":
            return self.batch_invariant
        if self.tensor_parallel_size == "auto":
            return None
        return self.parallel_sizes()[0] == 1

    @model_validator(mode="after")
    def _check_parallel_sizes(self) -> GeneratorConfig:
        """A replica's GPUs and its shards must agree before anything is placed (num_gpus = tp x pp)."""

        def refuse(key: str, message: str):
            # the error's key is the field's (generator.num_gpus, zerorag.qa_generator.tensor_parallel_size)
            return ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("parallel_sizes", message), loc=(key,), input=getattr(self, key))])

        gpus = self.num_gpus
        if self.backend != "vllm":
            if self.backend == "hf" and gpus > 1:
                raise refuse("num_gpus", "the hf backend runs a model on one GPU; set backend: vllm to shard it "
                             f"over {gpus:g} GPUs (tensor / pipeline parallel), or num_gpus: 1")
            for key in ("tensor_parallel_size", "pipeline_parallel_size"):
                if getattr(self, key) == "auto" or (getattr(self, key) or 1) > 1:
                    raise refuse(key, f"only the vllm backend shards a model over GPUs (backend: {self.backend}); "
                                 f"set backend: vllm, or drop {key}")
            return self
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            if key in self.vllm_engine_kwargs:
                raise refuse("vllm_engine_kwargs", f"set {key} itself, not in vllm_engine_kwargs: the engine "
                             "replica's GPU bundles are placed from it")
        if self.tensor_parallel_size == "auto":
            if gpus < 1:
                raise refuse("tensor_parallel_size", "auto sizes a replica in whole GPUs: set num_gpus: 1 (or more) "
                             "with it (num_gpus then follows the size chosen), or give tensor_parallel_size itself")
            return self
        if isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size < 1:
            raise refuse("tensor_parallel_size", "at least 1, or 'auto'")
        tp, pp = self.parallel_sizes()
        if gpus > 1 and gpus != int(gpus):
            raise refuse("num_gpus", "an engine replica larger than one GPU takes whole GPUs")
        if self.tensor_parallel_size is None and gpus > 1 and int(gpus) % pp:
            raise refuse("num_gpus", f"{gpus:g} GPUs do not split into pipeline_parallel_size={pp} stages of "
                         "equal size; set tensor_parallel_size too (num_gpus = tensor_parallel_size x "
                         "pipeline_parallel_size)")
        if gpus == 0 and pp == 1:  # vLLM's CPU build: tensor-parallel ranks as processes (`parallel.replica_placement`)
            return self
        if tp * pp > 1 and gpus < 1:
            cpu = "; on CPUs (num_gpus: 0) only tensor_parallel_size shards a replica" if gpus == 0 else ""
            raise refuse("num_gpus", f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} runs on GPUs, "
                         f"one per shard; set num_gpus: {tp * pp}{cpu}")
        if (tp * pp > 1 or gpus > 1) and gpus != tp * pp:
            raise refuse("num_gpus", f"a replica of tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} "
                         f"shards holds {tp * pp} GPUs, one per shard; make num_gpus and the product equal")
        memory = self.vllm_engine_kwargs.get("gpu_memory_utilization", 0)
        if 0 < gpus < 1 and memory > gpus:  # a GPU shared with search actors or query embedders
            raise refuse("vllm_engine_kwargs", f"gpu_memory_utilization={memory:g} is more of the GPU than the "
                         f"replica's share (num_gpus={gpus:g}): the actors placed beside it would run out of GPU "
                         "memory; set it below the share")
        return self


class IndexConfig(_Section):
    unit: Literal["passage", "sentence"] = Field("passage", description="What the index holds: passages (RAG) or "
                                                 "sentences (Zero-RAG's pruning unit).")
    factory: str = Field("auto", description="faiss index factory string (Flat, IVF4096,Flat, IVF4096,PQ48, HNSW32, "
                         "...), or 'auto': chosen from the vector count and the memory settings (choose_factory).")
    train_sample: int = Field(100_000, ge=1, description="Vectors sampled to train an index; an IVF's sample is "
                              "raised to 39 x its lists, capped by index.train_memory_gb.")
    train_memory_gb: float = Field(8.0, gt=0, description="Memory the training sample may take (sample x dim x 4 "
                                   "bytes): factory auto gives an IVF fewer lists to fit; an explicit factory that "
                                   "cannot is refused before any work.")
    nprobe: PositiveOrAuto = Field(
        "auto", description="IVF lists visited per query, or 'auto': the fewest that reach index.target_recall, "
        "measured at build time (else max(min(nlist, 32), sqrt(nlist))). An HNSW quantizer searches with efSearch "
        "= max(2 x nprobe, index.ef_search).")
    target_recall: float | None = Field(0.95, gt=0, le=1, description="recall@10 of exact search the build tunes "
                                        "nprobe / efSearch (auto, unset) to; an explicit setting is measured. null: "
                                        "no measurement.")
    recall_queries: int = Field(500, ge=10, description="Vectors searched to measure recall (500 give recall@10 to "
                                "about +-0.01).")
    num_shards: PositiveOrAuto = Field("auto", description="Index shards, each loaded by one search actor; 'auto': "
                                       "ceil(estimated index bytes / index.shard_memory_gb).")
    shard_memory_gb: float = Field(4.0, gt=0, description="num_shards auto: the most bytes one index shard may take "
                                   "(one merge task's and one search actor's memory).")
    memory_budget_gb: float = Field(16.0, gt=0, description="Memory the whole index may take at search time; factory "
                                    "auto picks codes that fit it.")
    ef_search: int | None = Field(None, ge=1, description="HNSW efSearch at query time (None: the one the build "
                                  "measured to index.target_recall, else faiss's default, 16).")
    k_factor: float | None = Field(None, ge=1, description="Refine indices (...,RFlat): candidates re-ranked per "
                                   "result (None: faiss's default, 1).")
    num_cpus: float = Field(1.0, gt=0, description="CPUs each index build task (train, add, merge) asks Ray for.")
    gpu: bool | Literal["auto"] = Field("auto", description="Search (and train IVF k-means) on GPUs. 'auto': where "
                                        "the cluster has GPUs and faiss GPU support (logged); true: GPUs or refused.")


class RetrievalConfig(_Section):
    """Retrieval passes and their service: search actors of at most `actor_memory_gb`, `concurrency` each."""

    RUNTIME_KEYS = frozenset({"batch_size", "search_cpus", "search_gpus", "embed_gpus", "actor_memory_gb"})

    top_k: int = Field(5, ge=1, description="Documents retrieved per question (K).")
    batch_size: int = Field(64, ge=1, description="Questions embedded and searched per batch.")
    num_cpus: float = Field(0.25, gt=0, description="CPUs each retrieval-pass actor (query embedder, router) asks "
                            "Ray for.")
    search_cpus: float = Field(0.25, gt=0, description="CPUs each search actor asks Ray for (faiss threads: "
                               "rounded up).")
    search_gpus: float | Literal["auto"] = Field(
        "auto", description="GPU share of each search actor on GPU: 1 holds a whole GPU; a share (0.05) places it "
        "beside an engine replica. 'auto': whole GPUs where that costs the generator at most one replica in eight, "
        "else a share sized from the index (wbrag_ray.placement.gpus).")
    embed_gpus: float | Literal["auto"] | None = Field(
        "auto", description="GPU share of each query embedder; None: embedder.num_gpus. 'auto': embedder.num_gpus, "
        "or a share sized from the model where retrieval.search_gpus auto takes shares.")
    actor_memory_gb: float = Field(8.0, gt=0, description="Index bytes one search actor holds at most (shards are "
                                   "grouped up to this).")
    concurrency: int = Field(1, ge=1, description="Replicas of every search actor (queries are spread over them), and "
                             "retrieval-pass actors.")
    replug_temperature: float = Field(0.1, gt=0, description="RePlug: documents are weighted by softmax(retrieval "
                                      "score / temperature).")
    union: Literal["auto", "score", "provenance", "rrf", "gate", "gate-no-provenance", "additive"] = Field(
        "auto", description="How base and write-back hits share the prompt (wbrag_ray.retrieval.union, docs/guide.md):"
        " 'score' is WriteBack-RAG's merge by score. 'auto': the rule the write-back version chose on its validation "
        "split (score unless another won beyond chance), else 'provenance'.")
    max_units: int | None = Field(None, ge=0, description="Write-back units per query at most (none: no cap; "
                                  "'additive': 1 where unset); not applied by union 'score'.")
    rrf_k: int = Field(60, ge=1, description="Reciprocal rank fusion's constant: a hit's fused score is "
                       "1 / (rrf_k + its rank in its own index).")
    gate_margin: float = Field(0.0, description="Union 'gate': how far below the best passage's score a unit may "
                               "score and still take a slot.")
    additive_margin: float = Field(0.0, description="Union 'additive': how far below the K-th passage's score a unit "
                                   "may score and still be appended.")

    @field_validator("search_gpus", "embed_gpus")
    @classmethod
    def _share(cls, v, info):
        if isinstance(v, int | float) and not (0 <= v <= 1) or v == 0 and info.field_name == "search_gpus":
            raise ValueError("a share of one GPU: above 0 (search) or at least 0 (query embedders), at most 1; or 'auto'")
        return v

    @property
    def search_share(self) -> float:
        """What each search actor asks of a GPU where it searches on one: `search_gpus`, 1 while still 'auto'."""
        return 1.0 if self.search_gpus == "auto" else float(self.search_gpus)

    def query_embedder(self, embedder: EmbedderConfig) -> EmbedderConfig:
        """The embedder as retrieval's actors hold it: with `embed_gpus` where set."""
        if self.embed_gpus is None or self.embed_gpus == "auto":
            return embedder
        return embedder.model_copy(update={"num_gpus": self.embed_gpus})


RagMethod = Literal["no-retrieval", "naive", "replug", "replug-vote", "self-rag", "flare"]


class FlareConfig(_Section):
    """FLARE: write a sentence at a time; retrieve for an unsure sentence with it as query, and write it again."""

    threshold: float = Field(0.2, ge=0, le=1, description="Retrieve when a token of the look-ahead sentence has "
                             "probability below this (FLARE's theta; 0 never retrieves, 1 always does).")
    max_rounds: int = Field(3, ge=1, description="Sentences written at most (a look-ahead, maybe a retrieval, each).")
    look_ahead_tokens: int = Field(32, ge=1, description="New-token budget of one look-ahead / regenerated sentence.")
    mask_query: bool = Field(True, description="Query with the sentence's confident tokens only (FLARE's masked "
                             "query).")
    query_with_question: bool = Field(True, description="Prefix the query with the question: a short answer sentence "
                                      "alone says little.")


class SelfRagConfig(_Section):
    """Self-RAG by prompted judgements: whether to retrieve, each document's relevance, answer from the relevant."""

    retrieval_threshold: float = Field(0.2, ge=0, le=1, description="Retrieve when the retrieval judgement's p(yes) "
                                       "share is at least this (Self-RAG's delta; 0 always retrieves).")
    relevance_threshold: float = Field(0.5, ge=0, le=1, description="Keep a document whose relevance judgement's "
                                       "p(yes) share is at least this.")
    keep_best: bool = Field(True, description="When no document passes, answer from the one judged most relevant (as "
                            "Self-RAG); False answers closed-book.")


class RagConfig(_Section):
    """Settings of the adaptive RAG methods (wherever a method is chosen: evaluation, write-back scoring)."""

    flare: FlareConfig = Field(default_factory=FlareConfig)
    self_rag: SelfRagConfig = Field(default_factory=SelfRagConfig)


class EvalConfig(_Section):
    dataset: str | None = Field(None, description="FlashRAG dataset jsonl or Parquet (id, question, golden_answers).")
    name: str | None = Field(None, description="Name of the evaluation folder; default: the dataset's file stem.")
    methods: list[RagMethod] = Field(default_factory=lambda: ["no-retrieval", "naive"], description="RAG methods to "
                                     "evaluate (replug, a probability mixture, needs the hf backend).")
    limit: int | None = Field(None, ge=1, description="Evaluate only the first N questions.")
    answer_form: Literal["span"] | None = Field(
        None, description="How an answer is scored: unset, as generated (the papers); 'span': the answer span cut "
        "from a sentence-long answer (evaluation/short_answer.py). Predictions keep both.")


# writeback.validation: 'auto' holds out this fraction from this many training questions on (at least 20 held out)
AUTO_VALIDATION = 0.2
AUTO_VALIDATION_MIN = 100


class WritebackConfig(_Section):
    """WriteBack-RAG training: which examples and documents are useful, and how they are distilled."""

    train: str | None = Field(None, description="Labeled QA set (FlashRAG jsonl / Parquet) to learn write-back from.")
    version: str | None = Field(None, description="Name of the write-back index version (RUN/writeback/<version>); "
                                "default: the train file stem.")
    limit: int | None = Field(None, ge=1, description="Use only the first N training examples.")
    metric: Literal["acc", "em", "f1", "auto"] = Field(
        "acc", description="Task metric of the gates; 'auto': the paper's choice for the training set's dataset "
        "(acc: NQ, BoolQ, zsRE, HotpotQA; F1: FEVER; EM: SQuAD).")
    rag_method: Literal["naive", "replug", "replug-vote", "self-rag", "flare"] = Field(
        "naive", description="RAG method whose answers score s_rag and whose documents the gates and the distiller "
        "see (replug: hf backend).")
    tau_s: float = Field(0.1, description="Utility gate: keep an example only if s_rag >= tau_s.")
    tau_delta: float = Field(0.01, description="Utility gate: keep an example only if s_rag - s_nr > tau_delta.")
    tau_doc: float = Field(0.01, description="Document gate: keep document j only if s_j - s_nr > tau_doc.")
    n_min: int = Field(2, ge=1, description="Document gate fallback: keep the top n_min documents by rank if none pass.")
    extract_max_new_tokens: int = Field(128, ge=1, description="Distiller step 1 (extract answer-relevant "
                                        "sentences): new-token budget.")
    rewrite_max_new_tokens: int = Field(128, ge=1, description="Distiller step 2 (rewrite as one self-contained "
                                        "document): new-token budget.")
    dedupe_threshold: float | None = Field(0.95, gt=0, le=1.0, description="Merge a unit into an earlier one at "
                                           "embedding cosine >= this (provenance kept); null: none (the paper).")
    index_factory: str = Field("Flat", description="faiss factory of the write-back index (small: Flat; IVF needs "
                               "more units than cells).")
    validation: float | Literal["auto"] | None = Field(
        "auto", description="Fraction of the training questions held out (by a hash of their ids): base vs base + "
        "version is evaluated on them, so a version that hurts is seen before it is activated (the result is in the "
        f"version's stats). 'auto': {AUTO_VALIDATION} from {AUTO_VALIDATION_MIN} questions on, else none. None: none.")
    activate: bool = Field(True, description="Make the new version the active write-back index when it is built "
                           "(not when its validation shows it hurts).")
    evaluate: bool = Field(True, description="`wbrag run`: also evaluate eval.dataset with base + write-back after "
                           "training.")

    @field_validator("validation")
    @classmethod
    def _validation(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not 0 < v < 1:
            raise ValueError("must be a fraction between 0 and 1 (exclusive), 'auto' or null")
        return v

    def validation_fraction(self, questions: int) -> float | None:
        """Fraction of training questions held out: `validation`, or 'auto' (AUTO_VALIDATION from AUTO_VALIDATION_MIN)."""
        if self.validation == "auto":
            return AUTO_VALIDATION if questions >= AUTO_VALIDATION_MIN else None
        return self.validation


class TrainerConfig(_Section):
    """Where a training runs: data-parallel Ray Train workers; the worker count changes speed, not the result, so it
    is left out of the fingerprint."""

    RUNTIME_KEYS = frozenset({"num_workers", "checkpoint_steps", "max_failures", "strategy", "timeout_s"})

    num_workers: PositiveOrAuto = Field(1, description="Ray Train workers (data-parallel; under ddp each holds the whole "
                             "model, under fsdp each holds 1 / num_workers of it)." + AUTO_CONCURRENCY + " At most batch_size.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="How workers share the model. ddp: each holds all of it. fsdp: FSDP2 shards the frozen base "
        "and adapter over the workers, one GPU each, with gradient checkpointing (hybrid across nodes: sharded within a "
        "node, replicated across). One worker trains as ddp.")
    num_cpus: float = Field(1.0, gt=0, description="CPUs each training worker asks Ray for (its torch threads).")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs per training worker: 0 trains on CPU (fp32, gloo); 1 on one GPU (bf16 or fp16, "
        "LoRA in fp32; nccl); more spreads a model one GPU cannot hold over that many GPUs of its node (accelerate).")
    checkpoint_steps: int = Field(50, ge=1, description="Optimizer steps between training checkpoints: what a lost "
                                  "worker or driver can cost at most.")
    max_failures: int = Field(2, ge=0, description="Worker-group failures Ray Train recovers from (from the last "
                              "checkpoint) before the stage fails.")
    timeout_s: int | Literal["auto"] = Field("auto", description="Seconds a collective may wait (TorchConfig "
                                             "timeout_s). 'auto': the weights read at 50 MB/s, at least 1800 s.")

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus(cls, value: float) -> float:
        # A worker's GPUs are its own: two ranks Ray packs onto one GPU make NCCL fail at the first collective.
        if value != int(value):
            whole = max(1, round(value))
            raise ValueError(f"a training worker takes whole GPUs (NCCL refuses two ranks on one GPU): set num_gpus: "
                             f"{whole} (or 0 to train on CPUs), and num_workers to the GPUs the training may use")
        return value

    @model_validator(mode="after")
    def _check_strategy(self) -> TrainerConfig:
        if self.strategy == "fsdp" and self.num_gpus > 1:
            raise ValueError(f"strategy fsdp runs one worker per GPU (num_gpus: 1) and shards the model over all of "
                             f"them; for {self.num_workers} workers of {self.num_gpus:g} GPUs set num_workers: "
                             f"{'auto' if self.num_workers == 'auto' else self.num_workers * int(self.num_gpus)} and "
                             "num_gpus: 1")
        return self


class _LoraSection(_Section):
    """LoRA (peft) settings shared by the LM pruner and noise-tolerant tuning."""

    lora_r: int = Field(8, ge=1, description="LoRA rank.")
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (alpha / r scales the update).")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA path.")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], description="Modules that get "
                                      "LoRA adapters.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training examples (the scored sentences, the "
                          "tuning rows); fractions allowed. Steps = ceil(epochs x examples / batch_size).")
    max_steps: int | None = Field(None, ge=1, description="Optional cap on optimizer steps (the stats say how many "
                                  "examples were seen).")
    batch_size: int = Field(8, ge=1, description="Examples per optimizer step, over all training workers.")
    learning_rate: float = Field(5e-4, gt=0, description="AdamW learning rate.")
    max_length: int = Field(128, ge=8, description="Tokens per example (longer inputs are truncated).")
    seed: int = Field(0, description="Seed of data order and LoRA initialization.")
    threads: int | None = Field(None, ge=1, description="torch threads per training worker (default: ceil(trainer."
                                "num_cpus)).")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)


class LMPrunerConfig(_LoraSection):
    """Zero-RAG's LM regressor: a small causal LM with a regression head, fine-tuned with LoRA."""

    RUNTIME_KEYS = frozenset({"predict_batch_size"})

    backbone: str = Field(BUNDLED_GENERATOR, description="Backbone LM: local folder, GGUF file, hub id or bundled:*.")
    max_length: int = Field(64, ge=8, description="Tokens per sentence (longer sentences are truncated).")
    predict_batch_size: int = Field(16, ge=1, description="Sentences per forward pass when predicting (raise it on "
                                    "GPUs).")
    num_cpus: float = Field(1.0, gt=0, description="CPUs each prediction actor asks Ray for.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per prediction actor.")
    concurrency: PositiveOrAuto = Field(1, description="Number of prediction actors." + AUTO_CONCURRENCY)


class TuneConfig(_LoraSection):
    """Zero-RAG's noise-tolerant tuning: each training question with relevant documents, distractors, and none."""

    RUNTIME_KEYS = frozenset({"enabled"})

    enabled: bool = Field(False, description="`wbrag run`: tune an adapter and evaluate with it.")
    docs_per_format: int | None = Field(None, ge=1, description="Documents in the relevant and distracting formats; "
                                        "None: retrieval.top_k (the count evaluation prompts hold).")
    retrieve_k: int = Field(10, ge=1, description="Documents retrieved per training question (at least "
                            "retrieval.top_k), from which relevant and distracting ones are picked.")
    weight_retrieval_free: float = Field(1.0, ge=0, description="Weight of the retrieval-free term (no documents).")
    weight_relevant: float = Field(1.0, ge=0, description="Weight of the retrieval-augmented term (relevant documents).")
    weight_noise: float = Field(1.0, ge=0, description="Weight of the noise-suppression term (distracting documents).")
    targets: Literal["gold", "own"] = Field(
        "gold", description="What each row is trained to answer: 'gold' (the first gold answer, the paper) or 'own' "
        "(the generator's own answer where it holds a gold one; other rows dropped; noise_tolerant.own_targets).")
    batch_size: int = Field(4, ge=1, description="Examples per optimizer step.")
    learning_rate: float = Field(3e-4, gt=0, description="AdamW learning rate (the paper's 3e-4).")
    max_length: int = Field(384, ge=8, description="Tokens per example (prompt + answer; prompts truncated left).")


class ZeroRagConfig(_Section):
    """Zero-RAG: mastery scores on a sample, a pruner, a corpus-wide percentile, router and tuning."""

    RUNTIME_KEYS = frozenset({"enabled"})

    enabled: bool = Field(False, description="`wbrag run`: after the index, score mastery, train the pruner(s), prune "
                          "at every ratio and evaluate the grid (needs index.unit=sentence).")
    sample: int = Field(2000, ge=1, description="Sentences sampled for mastery scoring.")
    seed: int = Field(0, description="Seed of the mastery sample and of the pruner's train / validation split.")
    qa_mode: Literal["cloze", "llm"] = Field("cloze", description="How QA pairs are written: 'llm' (the QA generator) "
                                             "or 'cloze' (names, numbers and dates blanked; for tiny models).")
    qa_per_sentence: int = Field(3, ge=1, description="QA pairs per sampled sentence (n).")
    qa_generator: GeneratorConfig | None = Field(None, description="The model that writes QA pairs in llm mode (the "
                                                 "paper: a strong LLM); None: the generator.")
    qa_max_new_tokens: int = Field(96, ge=8, description="llm mode: new-token budget for writing the QA pairs.")
    answer_max_new_tokens: int = Field(16, ge=1, description="The target model's closed-book answers: token budget.")
    mastery_metric: Literal["em", "acc"] = Field("em", description="Per-pair score averaged into mastery: 'em' (the "
                                                 "paper) or 'acc' (answer occurs in the prediction). Both are stored.")
    pruner: Literal["embedding", "lm"] = Field("embedding", description="Which pruner predicts mastery for the "
                                               "corpus: 'embedding' (a head on the stored sentence vectors) or 'lm' "
                                               "(the LoRA LM regressor).")
    train_pruners: list[Literal["embedding", "lm"]] = Field(
        default_factory=lambda: ["embedding"], description="Pruners `wbrag train-pruner` trains (and validates).")
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Held-out part of the scored sample.")
    head_hidden: int = Field(128, ge=0, description="Embedding head: hidden units (0: a linear head).")
    head_epochs: int = Field(200, ge=1, description="Embedding head: full-batch training epochs.")
    head_weight_decay: float = Field(1e-3, ge=0, description="Embedding head: AdamW weight decay.")
    lm_pruner: LMPrunerConfig = Field(default_factory=LMPrunerConfig)
    ratios: list[Annotated[float, Field(ge=0, lt=1)]] = Field(
        default_factory=lambda: [0.3], description="`wbrag run`: pruning ratios to build and evaluate (0 = full index).")
    checkpoint_rows: int = Field(100_000, ge=1, description="Pruner prediction: about this many sentences per written "
                                 "block: what a killed pass can lose per task.")
    histogram_bins: int = Field(4096, ge=16, description="Bins per level of the distributed percentile (two levels: "
                                "1/bins^2 resolution).")
    train: str | None = Field(None, description="Labeled QA set for the query router and noise-tolerant tuning "
                              "(FlashRAG jsonl / Parquet).")
    train_limit: int | None = Field(None, ge=1, description="Use only the first N training questions.")
    router: bool = Field(False, description="`wbrag run`: train the query router and evaluate with it.")
    router_metric: Literal["acc", "em", "f1"] = Field("acc", description="Router labels: a training question is "
                                                      "'mastered' when this metric of the closed-book answer is > 0.")
    router_threshold: float = Field(0.5, gt=0, lt=1, description="Router: a query is 'mastered' (retrieval skipped) "
                                    "when P(correct) >= this.")
    tune: TuneConfig = Field(default_factory=TuneConfig)

# Settings that may be "auto": section -> the count it sizes (`cluster_nodes.auto_concurrency`).
AUTO_SETTINGS = {"embedder": "concurrency", "generator": "concurrency", "zerorag.lm_pruner": "concurrency",
                 "zerorag.lm_pruner.trainer": "num_workers", "zerorag.tune.trainer": "num_workers"}


class WbragConfig(_Section):
    """The whole configuration of one run; `run.json` in the run folder holds its resolved form."""

    run: str | None = Field(None, description="Run folder (local path or s3://bucket/prefix) for `wbrag run`.")
    ray: RayConfig = Field(default_factory=RayConfig)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    embedder: EmbedderConfig = Field(default_factory=EmbedderConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    rag: RagConfig = Field(default_factory=RagConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    writeback: WritebackConfig = Field(default_factory=WritebackConfig)
    zerorag: ZeroRagConfig = Field(default_factory=ZeroRagConfig)
    # the counts that were "auto" before a command decided them; each command decides them again
    _auto_sections: frozenset[str] = PrivateAttr(default_factory=frozenset)
    # the GPU settings as the config said them before a command decided its "auto" ones
    _layout_said: dict[str, Any] | None = PrivateAttr(default=None)

    @field_validator("index")
    @classmethod
    def _factory_known(cls, v: IndexConfig) -> IndexConfig:
        if not v.factory.strip():
            raise ValueError("factory must be a faiss index factory string such as 'Flat' or 'IVF1024,Flat'")
        return v

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide a run's outputs (ray placement excluded), with "auto" placement as configured."""
        data = self.model_dump(mode="json")
        data.pop("ray", None)
        data.pop("run", None)
        said = {f"{key}.{AUTO_SETTINGS[key]}": "auto" for key in self._auto_sections}
        said.update(self._layout_said or {})
        for path, value in said.items():
            set_dotted(data, path, value)
        return data


# --- loading -------------------------------------------------------------------------------------------


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, list[Any]]:
    """Every dotted key below `model` (into its sections, optional ones too) -> the types its value may take."""
    keys: dict[str, list[Any]] = {}
    for name, field in model.model_fields.items():
        # a union's members are its options; list[str]'s argument is not (the value is a list)
        union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
        options = [o for o in (typing.get_args(field.annotation) if union else (field.annotation,)) if o is not type(None)]
        section = next((o for o in options if isinstance(o, type) and issubclass(o, BaseModel)), None)
        if section is not None:
            keys.update(_leaves(section, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = options
    return keys


# Keys that were removed, and what to do instead.
REMOVED_KEYS = {
    "ray.keep_services_s": "a command's services now end with it (keeping them for the next command saved under "
    "10% of a run: benchmarks/RESULTS.md); delete the key",
}


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden" and key in REMOVED_KEYS:
        return f"config key '{key}' was removed: {REMOVED_KEYS[key]}"
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key, list(_leaves(WbragConfig)), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "remove it; see `wbrag <cmd> --help` for keys"
        return f"unknown config key '{key}': {hint}"
    got = err.get("input")
    fix = err["msg"][0].lower() + err["msg"][1:]
    return f"config key '{key}' = {got!r} is invalid: {fix}"


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """tree[a][b][c] = value for key 'a.b.c', making the sections that are missing."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """Turn ['generator.batch_size=8', ...] into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. --set generator.batch_size=16")
        key, raw = pair.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"--set {pair!r}: the key is empty")
        set_dotted(tree, key, _override_value(key, raw))
    return tree


def _leaf_kinds(key: str) -> set[type]:
    """The types a dotted config key's value takes (a Literal's: its values'); empty where the key names no field."""
    kinds: set[type] = set()
    for option in _leaves(WbragConfig).get(key, ()):
        literal = typing.get_origin(option) is Literal
        kinds |= {type(v) for v in typing.get_args(option)} if literal else {typing.get_origin(option) or option}
    return kinds


def _override_value(key: str, raw: str) -> Any:
    """A --set value: text for a text setting, else a YAML scalar (yes / no refused for a number)."""
    if not raw.strip():
        return None
    kinds = _leaf_kinds(key)
    if kinds == {str} and raw.strip() not in ("null", "~"):
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"--set {key}={raw}: not a YAML value ({problem}); quote text: --set '{key}=\"{raw}\"'"
                          ) from None
    if isinstance(value, bool) and kinds and bool not in kinds and kinds & {int, float}:
        raise ConfigError(f"--set {key}={raw}: {key} is a number, not yes / no")
    return value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build_config(data: dict[str, Any]) -> WbragConfig:
    try:
        return WbragConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e) for e in exc.errors()]
        if len(lines) == 1:  # the common case reads as one line
            raise ConfigError(f"invalid configuration: {lines[0]}") from None
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    extra: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> WbragConfig:
    """Load YAML (optional; else `base`, a run's recorded config), then apply `extra` (from CLI flags), then `--set`
    overrides, and validate once."""
    data: dict[str, Any] = base or {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {str(p)!r} is a folder: name a YAML file in it (e.g. jobs/configs/demo.yaml)")
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}): save "
                              "it as UTF-8") from None
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {problem}{at}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections (ingest:, generator:, ...)")
        data = loaded
    data = deep_merge(data, extra or {})
    data = deep_merge(data, parse_overrides(overrides))
    return build_config(data)
