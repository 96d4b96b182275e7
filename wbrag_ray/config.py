"""Typed configuration: one model for a whole run, loaded from YAML plus `--set key=value` overrides.

Validation happens once, before any stage starts; every error names the dotted key and what would fix it.

Over 600 lines (about 850) on purpose: one model per config section, every field with its description, in one module
that is the reference a user reads (`wbrag_ray/config.py` is what the README points to); splitting the sections
into modules would split that reference, and the loader and override parser below serve them all.
"""

from __future__ import annotations

import difflib
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


# A pool's actor count (or a training's workers): a number, or "auto": as many as the cluster has room for, decided
# by each command as it joins Ray, after the commands before it built what it uses (`cluster_nodes.auto_concurrency`;
# `wbrag plan` decides it on the cluster it plans for).
Concurrency = Annotated[int | Literal["auto"], BeforeValidator(_concurrency)]
AUTO_CONCURRENCY = (" 'auto': as many as the cluster holds (an autoscaling cluster: its declared maximum), decided by "
                    "each command as it joins Ray (GPU actors: the GPUs, the generator's less those the index's search "
                    "actors and query embedders hold; CPU actors: the CPUs, less one for reads).")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Keys that never change what a stage writes (batch sizes of inference, caches, switches of `wbrag run`):
    # left out of stage fingerprints, as placement keys are (wbrag_ray.run).
    RUNTIME_KEYS: ClassVar[frozenset[str]] = frozenset()


class RayConfig(_Section):
    address: str | None = Field(
        None, description="Ray cluster to join ('auto', 'ray://host:10001', host:port). None starts a local one."
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster (local clusters only).")
    pending_timeout_s: float = Field(
        1800.0, gt=0, description="How long a service's actors (generator, embedder, search) may wait for a node with "
        "the resources they ask before the command fails naming what is missing (the resources may be held by "
        "another job; an autoscaler may be adding nodes)."
    )
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="Memory of one GPU of the cluster, for the placement rules that size "
        "tensor_parallel_size auto and retrieval's GPU shares. None: from the GPU model Ray labels the nodes with "
        "(accelerator_type: H100 80 GB, H200 141 GB, ...; wbrag_ray.plan.accelerators), else 80 GB, said in the log.",
    )


class IngestConfig(_Section):
    corpus: str | None = Field(None, description="FlashRAG corpus: jsonl or Parquet file or folder, local or s3://.")
    shard_bytes: int = Field(
        64 << 20, ge=1024, description="Byte size of one ingest shard of a jsonl file (a huge file is split)."
    )
    max_passage_chars: int = Field(
        100_000, ge=16, description="Longer passages are rejected with a reason (protects segmentation and memory)."
    )
    min_sentence_chars: int = Field(
        1, ge=1, description="Sentences shorter than this (after stripping) are not kept as sentences."
    )


class EmbedderConfig(_Section):
    RUNTIME_KEYS = frozenset({"batch_size", "trust_remote_code"})

    model: str = Field(
        BUNDLED_EMBEDDER, description="sentence-transformers model: local folder, s3:// folder, hub id or bundled:*."
    )
    batch_size: int = Field(64, ge=1, description="Sentences per forward pass.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype; 'auto' takes bf16 where the CPU or GPU supports it (measured here with "
        "MiniLM: 3.1x the fp32 speed, cosine to fp32 >= 0.9999, top-10 retrieval overlap 98.8%)."
    )
    storage_dtype: Literal["float32", "float16"] = Field("float32", description="dtype of stored embedding shards.")
    num_cpus: float = Field(
        1.0, gt=0, description="CPUs each embed actor asks Ray for; keep below the node's CPUs so reads can run."
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads per embed actor (default: ceil(num_cpus))."
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs per embed actor.")
    concurrency: Concurrency = Field(1, description="Number of embed actors." + AUTO_CONCURRENCY)
    max_seq_length: int | None = Field(None, ge=8, description="Truncate inputs to this many tokens.")
    query_prompt: str | None = Field(
        None, description="A prompt the model ships (sentence-transformers' `prompts`), put before every query, not "
        "before passages: s2p_query for stella_en_400M_v5, Zero-RAG's retriever. Unset: e5 models get their "
        "'query: ' / 'passage: ' prefixes, others none.",
    )
    trust_remote_code: bool = Field(
        False, description="Run the model's own Python code from its folder or hub repository (stella_en_400M_v5 "
        "ships its architecture as code): only for a model you trust.",
    )
    checkpoint_rows: int = Field(
        20_000, ge=1,
        description="About this many vectors per written block (= per file and per checkpoint commit): "
        "what a crash can cost at most per actor.",
    )


class GeneratorConfig(_Section):
    RUNTIME_KEYS = frozenset({"batch_size", "cache_dir", "api_key_env", "calls_per_engine", "pipeline_across_nodes",
                              "gpu_share"})

    backend: Literal["hf", "vllm", "openai"] = Field("hf", description="hf (transformers), vllm, or openai (HTTP).")
    model: str = Field(
        BUNDLED_GENERATOR,
        description="Local HF folder, s3:// folder (fetched once per node), GGUF file, hub id, or bundled:smollm2.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="hf backend compute dtype; 'auto' takes bf16 where the hardware supports it."
    )
    max_new_tokens: int = Field(32, ge=1, description="Greedy decoding stops after this many tokens.")
    batch_size: int = Field(
        32, ge=1, description="Most prompts per generate call (hf: fewer where long prompts would not fit memory_gb)."
    )
    memory_gb: float | None = Field(
        None, gt=0,
        description="hf backend: memory one generate call may use for its KV cache and activations; each batch "
        "of length-sorted prompts takes as many rows (up to batch_size) as fit. Default: 90% of the GPU memory "
        "left after loading the model, or half the node's available memory on CPU.",
    )
    stop: list[str] = Field(
        default_factory=lambda: ["\n"],
        description="Generation stops at the first of these strings, which is cut off: answers and judgements are "
        "one line, so a batch need not decode until its most talkative row fills max_new_tokens. Passes that "
        "write several lines (the distiller, QA writing) clear it.",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs each generator actor asks Ray for.")
    threads: int | None = Field(
        None, ge=1, description="torch threads per generator actor (default: ceil(num_cpus))."
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs per generator actor (vllm: per engine replica).")
    tensor_parallel_size: int | Literal["auto"] | None = Field(
        None, description="vllm: GPUs of one node that each layer of an engine replica is sharded over (with "
        "num_gpus: 0, vLLM's CPU build: rank processes of one node, num_cpus split between them). Default: "
        "num_gpus / pipeline_parallel_size when num_gpus > 1, else 1 (a replica that asks for 4 GPUs uses all 4). "
        "'auto' (GPUs: num_gpus >= 1): the fewest GPUs of one node that hold the weights and a KV cache for "
        "batch_size prompts (2 H200s or 4 80 GB GPUs for a 70B in bf16), decided as a command joins the cluster and "
        "by `wbrag plan`; num_gpus then follows (tensor_parallel_size x pipeline_parallel_size).",
    )
    gpu_share: float = Field(
        1.0, gt=0, le=1, description="What each GPU of a replica of several GPUs asks Ray for (vLLM's "
        "VLLM_RAY_PER_WORKER_GPUS): 1, or less to leave room for retrieval's actors beside a tensor-parallel "
        "replica; set by retrieval.search_gpus auto where retrieval takes shares (a one-GPU replica's share is "
        "num_gpus itself).",
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="vllm: stages an engine replica's layers are split into; num_gpus = "
        "tensor_parallel_size x pipeline_parallel_size (GPUs only).",
    )
    pipeline_across_nodes: bool = Field(
        False, description="vllm: a replica's pipeline stages may sit on different nodes (placement PACK: each "
        "stage's tensor_parallel_size GPUs still on one node). Off: the whole replica on one node (STRICT_PACK), "
        "its stages' hand-over at node-local speed.",
    )
    concurrency: Concurrency = Field(1, description="Number of generator actors / engine replicas." + AUTO_CONCURRENCY)
    calls_per_engine: int = Field(
        4, ge=1, description="vllm, a command's generator service: batches one engine takes at once; their requests "
        "share its running batch, so the engine decodes the next batch while the last one's longest answers finish "
        "(1: one blocking call at a time, the engine idle between two).",
    )
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template (instruct models).")
    batch_invariant: bool = Field(
        True, description="A prompt's greedy answer does not depend on what else is decoded beside it, so a resumed "
        "pass, a grid cell and a standalone evaluation give it one answer. hf: each prompt is padded to its 64-token "
        "length bucket and only prompts of one bucket share a batch (a little more padding, more calls on small "
        "passes); vllm on GPUs: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1, compute capability >= 8.0).",
    )
    checkpoint_rows: int = Field(
        1024, ge=1, description="Answers per committed block of a stage's answer checkpoint (or fewer: see "
        "checkpoint_seconds): what a killed generator pass can lose at most.",
    )
    checkpoint_seconds: float = Field(
        60.0, gt=0, description="The answers decoded since the last committed block are committed once this "
        "many seconds have passed, at the next finished batch, if checkpoint_rows did not come first: a slow pass "
        "(long prompts, a large model, an API) loses at most about this much decoding to a kill.",
    )
    cache_dir: str | None = Field(
        None, description="Where GGUF models are cached after de-quantization (default ~/.cache/wbrag/converted)."
    )
    base_url: str | None = Field(None, description="openai backend: the server's /v1 URL.")
    api_key_env: str = Field("OPENAI_API_KEY", description="openai backend: environment variable with the key.")
    lora_adapter: str | None = Field(
        None, description="LoRA adapter folder to apply (hf, vllm): a local path every node sees, or s3://... "
        "(each node that loads the generator fetches it into its own cache).")
    vllm_engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra vLLM engine arguments, merged over the throughput defaults."
    )

    def parallel_sizes(self) -> tuple[int, int]:
        """(tensor_parallel_size, pipeline_parallel_size) of one engine replica. The rule: pipeline_parallel_size
        as given; tensor_parallel_size as given, else num_gpus / pipeline_parallel_size when num_gpus > 1 (a
        replica that asks for 4 GPUs shards each layer over all 4, or over 2 per stage with 2 stages), else 1.
        A validated config has num_gpus = tp x pp whenever either is above 1, except a tensor-parallel replica of
        vLLM's CPU build (num_gpus 0, pp 1: ranks as processes) (`_check_parallel_sizes`). Other
        backends than vllm run a model whole: (1, 1)."""
        if self.backend != "vllm":
            return 1, 1
        pp = self.pipeline_parallel_size
        if self.tensor_parallel_size == "auto":
            raise ConfigError("generator.tensor_parallel_size auto is decided on the cluster before the engine starts "
                              "(`cluster_nodes.resolve_auto_concurrency`, `wbrag plan`); nothing decided it here")
        if self.tensor_parallel_size is not None:
            return self.tensor_parallel_size, pp
        if self.num_gpus > 1:
            return max(1, int(self.num_gpus) // pp), pp
        return 1, pp

    @model_validator(mode="after")
    def _check_parallel_sizes(self) -> GeneratorConfig:
        """A replica's GPUs and its shards must agree before anything is placed: vLLM starts one worker per GPU
        of the replica, each in a one-GPU bundle, and the hf backend moves its model to one device."""

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
    unit: Literal["passage", "sentence"] = Field(
        "passage", description="What the index holds: passages (RAG) or sentences (Zero-RAG's pruning unit)."
    )
    factory: str = Field(
        "auto",
        description="faiss index factory string (Flat, IVF4096,Flat, IVF4096,PQ48, OPQ48,IVF4096,PQ48, HNSW32, "
        "IVF4096,PQ48,RFlat), or 'auto': chosen from the vector count and index.memory_budget_gb "
        "(Flat below 20K vectors, else IVF with the most precise codes that fit and no more lists than get 39 "
        "training vectors each within index.train_memory_gb; see choose_factory).",
    )
    train_sample: int = Field(
        100_000, ge=1, description="Vectors sampled to train an index that needs training. An IVF's sample is raised "
        "to 39 x its lists (faiss's k-means wants 39 vectors per centroid), and no sample exceeds what "
        "index.train_memory_gb holds.",
    )
    train_memory_gb: float = Field(
        8.0, gt=0, description="Memory the training sample may take (sample x dim x 4 bytes): caps "
        "index.train_sample. With index.factory=auto, an IVF gets fewer lists when 39 vectors per list would not "
        "fit; an explicit IVF factory that cannot get them is refused before any work, naming the fix (raise this, "
        "or fewer lists): a factory you chose is never silently changed.",
    )
    nprobe: int | Literal["auto"] = Field(
        "auto", description="IVF lists visited per query: an integer, or 'auto': the fewest lists that find "
        "index.target_recall of exact search's top 10, measured when the index is built on index.recall_queries of "
        "its own vectors and recorded in its manifest (`search`; the build prints it). An index built without the "
        "measurement (index.target_recall: null, or an older build) takes max(min(nlist, 32), sqrt(nlist)). An HNSW "
        "coarse quantizer then searches with efSearch = max(2 x nprobe, index.ef_search), so it finds the nprobe "
        "nearest lists."
    )
    target_recall: float | None = Field(
        0.95, gt=0, le=1, description="The recall@10 of exact search the index build measures its search setting "
        "to: nprobe (IVF, with index.nprobe: auto) or efSearch (HNSW, index.ef_search unset) is the smallest that "
        "reaches it (where the codes cap recall below it, the smallest at the cap, with a warning); a setting given "
        "explicitly is what searches use, measured beside the choice. null: no measurement (no exact search at "
        "build time).",
    )
    recall_queries: int = Field(
        500, ge=10, description="Vectors of the index searched exactly and at each candidate setting to measure "
        "recall (index.target_recall): 500 give recall@10 to about +-0.01.",
    )
    num_shards: int | Literal["auto"] = Field(
        "auto", description="Index shards the build merges into, each built by its own merge task and loaded by "
        "one search actor (the results merged by score): an integer, or 'auto': ceil(estimated index bytes / "
        "index.shard_memory_gb), estimated from faiss's code size per vector plus the trained quantizer every "
        "shard carries (at most one shard per embedding shard)."
    )
    shard_memory_gb: float = Field(
        4.0, gt=0, description="index.num_shards=auto: the most bytes one index shard may take (its codes, ids "
        "and copy of the trained quantizer): the memory of one merge task and of one search actor's shard."
    )
    memory_budget_gb: float = Field(
        16.0, gt=0, description="Memory the whole index may take at search time; index.factory=auto picks codes "
        "that fit it."
    )
    ef_search: int | None = Field(None, ge=1, description="HNSW efSearch at query time (None: the one the build "
                                  "measured to index.target_recall, else faiss's default, 16).")
    k_factor: float | None = Field(
        None, ge=1, description="Refine indices (...,RFlat): candidates re-ranked per result (None: faiss's default, 1)."
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs each index build task (train, add, merge) asks Ray for.")
    gpu: bool | Literal["auto"] = Field(
        "auto", description="Search (and train an IVF's k-means) on GPUs. 'auto' (default): where the cluster has "
        "GPUs and faiss has GPU support (faiss-gpu, as the project's image installs), else on CPUs, said in the log. "
        "true: on GPUs or not at all: refused before any work where the cluster has no GPU or faiss no GPU support. "
        "false: on CPUs.")

    @field_validator("nprobe")
    @classmethod
    def _nprobe(cls, v: int | str) -> int | str:
        if v != "auto" and int(v) < 1:
            raise ValueError("nprobe must be at least 1, or 'auto'")
        return v

    @field_validator("num_shards")
    @classmethod
    def _positive_shards(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be a positive integer or 'auto'")
        return v


class RetrievalConfig(_Section):
    """Retrieval passes, and the retrieval service they run on: an index's shards grouped into search actors
    of at most `actor_memory_gb` each, `concurrency` replicas of every group (wbrag_ray.retrieval.service)."""

    RUNTIME_KEYS = frozenset({"batch_size", "search_cpus", "search_gpus", "embed_gpus", "actor_memory_gb"})

    top_k: int = Field(5, ge=1, description="Documents retrieved per question (K).")
    batch_size: int = Field(64, ge=1, description="Questions embedded and searched per batch.")
    num_cpus: float = Field(0.25, gt=0, description="CPUs each retrieval-pass actor (query embedder, router) asks "
                            "Ray for.")
    search_cpus: float = Field(0.25, gt=0, description="CPUs each search actor asks Ray for (faiss threads: "
                               "rounded up).")
    search_gpus: float | Literal["auto"] = Field(
        "auto", description="GPU share of each search actor where it searches on a GPU (index.gpu): 1 holds a whole "
        "GPU through every generation pass; a share (0.05) places it beside an engine replica of generator.num_gpus "
        "0.8 on one GPU (vLLM's memory kept below the replica's share), as retrieval.embed_gpus does the query "
        "embedders. 'auto' (default): whole GPUs where that costs the generator at most one replica in eight, else "
        "a share sized from the index's bytes beside every replica (wbrag_ray.gpu_layout; said in the log).",
    )
    embed_gpus: float | Literal["auto"] | None = Field(
        "auto", description="GPU share of each query embedder (a retrieval pass's actor); None: embedder.num_gpus, "
        "as the bulk embedding's actors. A share (0.05) places it beside an engine replica. 'auto' (default): "
        "embedder.num_gpus, or a share sized from the model where retrieval.search_gpus auto takes shares.",
    )
    actor_memory_gb: float = Field(
        8.0, gt=0, description="Index bytes one search actor holds at most: an index's shards are grouped up to "
        "this (a shard larger than it is a group of its own) and each group's memory is declared to Ray.",
    )
    concurrency: int = Field(1, ge=1, description="Replicas of every search actor (queries are spread over them), and "
                             "retrieval-pass actors.")
    replug_temperature: float = Field(
        0.1, gt=0, description="RePlug: documents are weighted by softmax(retrieval score / temperature)."
    )
    union: Literal["auto", "score", "provenance", "rrf", "gate", "gate-no-provenance", "additive"] = Field(
        "auto",
        description="How the base and write-back indices' hits share the prompt (wbrag_ray.retrieval.union): "
        "'score' is WriteBack-RAG's plain merge by score; 'provenance' the same merge, but a unit whose source "
        "documents are all in the top K (or whose text a taken hit holds) takes no slot; 'rrf' reciprocal rank "
        "fusion under the same rule; 'gate' the merge by score, a unit taking a slot only if its score is at least "
        "the query's best passage's less gate_margin, then the same rule; 'gate-no-provenance' the gate without the "
        "rule; 'additive' the base's top K kept whole and up to max_units units (1 where unset) appended after it, "
        "each scoring at least the K-th passage's score less additive_margin and not covered by the rule. 'auto' "
        "(the default): the rule the write-back version chose on its own validation split (the paper's score unless "
        "one of provenance, gate at three margins and additive at two answered better beyond chance, a sign test; "
        "wbrag_ray.writeback.validation), or 'provenance' "
        "where its split was too small to choose or none was held out. No one fixed rule served: 'gate', the "
        "earlier default, kept the base's acc on the held-out questions of benchmarks/writeback_union.py and let "
        "almost no unit in (benchmarks/RESULTS.md, 'Write-back that helps').",
    )
    max_units: int | None = Field(
        None, ge=0, description="Write-back units per query at most (none: no cap; under union 'additive', 1: "
        "a prompt then holds up to top_k + max_units documents); not applied by union 'score'.",
    )
    rrf_k: int = Field(60, ge=1, description="Reciprocal rank fusion's constant: a hit's fused score is "
                       "1 / (rrf_k + its rank in its own index).")
    gate_margin: float = Field(0.0, description="Union 'gate': how far below the query's best passage's score a "
                               "write-back unit may score and still take a slot (negative: it must score above).")
    additive_margin: float = Field(
        0.0, description="Union 'additive': how far below the K-th passage's score a write-back unit may score and "
        "still be appended after the base's top K (at 0: the units the paper's merge would have let into the top "
        "K, without the passage they would have pushed out).",
    )

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
        """The embedder as a retrieval pass's actors hold it: with `embed_gpus` where set (the bulk embedding
        keeps `embedder.num_gpus`; 'auto' until placement decides keeps it too)."""
        if self.embed_gpus is None or self.embed_gpus == "auto":
            return embedder
        return embedder.model_copy(update={"num_gpus": self.embed_gpus})


RagMethod = Literal["no-retrieval", "naive", "replug", "replug-vote", "self-rag", "flare"]


class FlareConfig(_Section):
    """FLARE (active retrieval): write the answer a sentence at a time; retrieve only for a sentence the model
    is unsure of, with that sentence as the query, and write it again with the documents."""

    threshold: float = Field(
        0.2, ge=0, le=1,
        description="Retrieve when a token of the look-ahead sentence has probability below this (FLARE's theta; "
        "0 never retrieves, 1 always does).",
    )
    max_rounds: int = Field(3, ge=1, description="Sentences written at most (a look-ahead, maybe a retrieval, each).")
    look_ahead_tokens: int = Field(32, ge=1, description="New-token budget of one look-ahead / regenerated sentence.")
    mask_query: bool = Field(
        True, description="Query with the sentence's confident tokens only (FLARE's masked query): an unsure "
        "token is likely wrong and would pull in documents about it.",
    )
    query_with_question: bool = Field(
        True, description="Prefix the query with the question: a short answer sentence alone says little.",
    )


class SelfRagConfig(_Section):
    """Self-RAG-style adaptive retrieval by prompted judgements (for models without Self-RAG's reflection
    tokens): judge whether to retrieve, judge each document's relevance, answer from the relevant ones."""

    retrieval_threshold: float = Field(
        0.2, ge=0, le=1,
        description="Retrieve when p(yes) / (p(yes) + p(no)) of the retrieval judgement is at least this "
        "(Self-RAG's delta, 0.2 by default as in its code; 0 always retrieves).",
    )
    relevance_threshold: float = Field(
        0.5, ge=0, le=1,
        description="Keep a retrieved document when its relevance judgement's p(yes) share is at least this "
        "(0.5: judged more relevant than not).",
    )
    keep_best: bool = Field(
        True,
        description="When no document passes, answer from the one judged most relevant: once Self-RAG retrieves, "
        "it always answers from its best-critiqued passage. False answers closed-book instead.",
    )


class RagConfig(_Section):
    """Settings of the adaptive RAG methods (wherever a method is chosen: evaluation, write-back scoring)."""

    flare: FlareConfig = Field(default_factory=FlareConfig)
    self_rag: SelfRagConfig = Field(default_factory=SelfRagConfig)


class EvalConfig(_Section):
    dataset: str | None = Field(None, description="FlashRAG dataset jsonl or Parquet (id, question, golden_answers).")
    name: str | None = Field(None, description="Name of the evaluation folder; default: the dataset's file stem.")
    methods: list[RagMethod] = Field(
        default_factory=lambda: ["no-retrieval", "naive"],
        description="RAG methods to evaluate: no-retrieval, naive, replug (probability mixture; hf backend), "
        "replug-vote, self-rag, flare.",
    )
    limit: int | None = Field(None, ge=1, description="Evaluate only the first N questions.")
    answer_form: Literal["span"] | None = Field(
        None, description="How an answer is scored: unset, as generated (the papers); 'span': the answer span cut "
        "from a sentence-long answer by a stated rule (wbrag_ray/evaluation/short_answer.py), for small models that "
        "answer in a sentence, so exact match means something. Predictions keep the generated text beside it.",
    )


# writeback.validation: 'auto' holds out this fraction from this many training questions on (at least 20 held out)
AUTO_VALIDATION = 0.2
AUTO_VALIDATION_MIN = 100


class WritebackConfig(_Section):
    """WriteBack-RAG training: which examples and documents are useful, and how they are distilled."""

    train: str | None = Field(None, description="Labeled QA set (FlashRAG jsonl / Parquet) to learn write-back from.")
    version: str | None = Field(
        None, description="Name of the write-back index version (RUN/writeback/<version>); default: the train file stem."
    )
    limit: int | None = Field(None, ge=1, description="Use only the first N training examples.")
    metric: Literal["acc", "em", "f1", "auto"] = Field(
        "acc", description="Task metric M(q, a | context) of the gates; 'auto': the paper's choice for the training "
        "set's dataset (acc for NQ, BoolQ, zsRE, HotpotQA; F1 for FEVER; EM for SQuAD; by the file's name)."
    )
    rag_method: Literal["naive", "replug", "replug-vote", "self-rag", "flare"] = Field(
        "naive",
        description="RAG method whose answers score s_rag and whose documents the document gate and the distiller "
        "see: naive, replug (probability mixture; hf backend), replug-vote (its per-document answers are the "
        "document gate's), self-rag (its relevant documents) or flare (the documents it retrieved).",
    )
    tau_s: float = Field(0.1, description="Utility gate: keep an example only if s_rag >= tau_s.")
    tau_delta: float = Field(0.01, description="Utility gate: keep an example only if s_rag - s_nr > tau_delta.")
    tau_doc: float = Field(0.01, description="Document gate: keep document j only if s_j - s_nr > tau_doc.")
    n_min: int = Field(2, ge=1, description="Document gate fallback: keep the top n_min documents by rank if none pass.")
    extract_max_new_tokens: int = Field(
        128, ge=1, description="Distiller step 1 (extract answer-relevant sentences): new-token budget."
    )
    rewrite_max_new_tokens: int = Field(
        128, ge=1, description="Distiller step 2 (rewrite as one self-contained document): new-token budget."
    )
    dedupe_threshold: float | None = Field(
        0.95, gt=0, le=1.0,
        description="A unit whose embedding cosine to an earlier unit is >= this is merged into it (provenance "
        "kept); null: no deduplication (the paper's setting).",
    )
    index_factory: str = Field(
        "Flat", description="faiss factory of the write-back index (small: Flat; IVF needs more units than cells)."
    )
    validation: float | Literal["auto"] | None = Field(
        "auto",
        description="Hold out this fraction of the training questions (chosen by a hash of their ids): the version "
        "is trained on the rest, and base vs base + version is evaluated on them, so a version that hurts is seen "
        "before it is activated, and its result (the metric both ways, won, lost, activated or not) is in the "
        f"version's stats. 'auto' (the default): hold out {AUTO_VALIDATION} when the training set has at least "
        f"{AUTO_VALIDATION_MIN} questions, so at least {round(AUTO_VALIDATION * AUTO_VALIDATION_MIN)} are held out (one "
        "question is then at most 0.05 of the metric; fewer could not tell a version that hurts from noise, and "
        "would cost a small set a larger share of its training questions); below that nothing is held out and the "
        "stats say validation was skipped. None: no hold-out.",
    )
    activate: bool = Field(True, description="Make the new version the active write-back index when it is built "
                           "(not when its validation shows it hurts).")
    evaluate: bool = Field(
        True, description="`wbrag run`: also evaluate eval.dataset with base + write-back after training."
    )

    @field_validator("validation")
    @classmethod
    def _validation(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float) and not 0 < v < 1:
            raise ValueError("must be a fraction between 0 and 1 (exclusive), 'auto' or null")
        return v

    def validation_fraction(self, questions: int) -> float | None:
        """The fraction of `questions` training questions held out: `validation`, or under 'auto' AUTO_VALIDATION
        from AUTO_VALIDATION_MIN questions on (None: nothing held out)."""
        if self.validation == "auto":
            return AUTO_VALIDATION if questions >= AUTO_VALIDATION_MIN else None
        return self.validation


class TrainerConfig(_Section):
    """Where a training runs: Ray Train workers, data-parallel. A step's batch (`batch_size` examples) is split
    across the workers and their gradients are averaged, so the number of workers changes the speed, not the
    optimization (the weights agree up to rounding): it is a placement setting, left out of the stage's
    fingerprint."""

    RUNTIME_KEYS = frozenset({"num_workers", "checkpoint_steps", "max_failures", "strategy", "timeout_s"})

    num_workers: Concurrency = Field(1, description="Ray Train workers (data-parallel; under ddp each holds the whole "
                             "model, under fsdp each holds 1 / num_workers of it)." + AUTO_CONCURRENCY + " At most batch_size.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="How the workers share the model. ddp: each worker holds all of it (on its GPU, or spread "
        "over its num_gpus GPUs layer by layer, one GPU busy at a time). fsdp: torch FSDP2 shards the frozen base and "
        "the adapter over the workers, one GPU each (num_gpus: 1, or 0 on CPU workers), with gradient "
        "checkpointing: for a generator no single GPU holds (the paper's 70B), every GPU of the training busy. On "
        "several nodes of as many workers each, fsdp is hybrid: sharded over the workers of a node (NVLink), "
        "replicated across nodes (a 2-D device mesh), so the weights' all-gathers never cross the network. One "
        "worker has nothing to shard over: it trains as ddp (said in the log).",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs each training worker asks Ray for (its torch threads).")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs each training worker asks Ray for: 0 trains on CPU (fp32, gloo); 1 trains on one "
        "GPU (bf16 weights where the GPU has bf16, else fp16, LoRA weights in fp32; nccl); more than 1 spreads one "
        "worker's model over that many GPUs of its node (a layer split by accelerate, one GPU busy at a time; strategy: "
        "fsdp keeps every GPU busy instead), for models one GPU cannot hold.",
    )
    checkpoint_steps: int = Field(
        50, ge=1, description="Optimizer steps between checkpoints in the run folder's stage checkpoint: what a lost "
        "worker or driver can cost at most (the training resumes from the last one).",
    )
    max_failures: int = Field(2, ge=0, description="Worker-group failures Ray Train recovers from (from the last "
                              "checkpoint) before the stage fails.")
    timeout_s: int | Literal["auto"] = Field(
        "auto", description="Seconds a collective of the training's process group may wait (Ray Train's TorchConfig "
        "timeout_s) before the training fails. The first one waits while worker 0 reads the whole model (fsdp: the "
        "others wait for its broadcast): 'auto' allows the model's weights read at 50 MB/s (a slow network volume), "
        "at least Ray Train's 1800 s.",
    )

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
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Modules that get LoRA adapters."
    )
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
    predict_batch_size: int = Field(
        16, ge=1, description="Sentences per forward pass when predicting (on 2 CPU cores, bf16: 132 sentences/s at "
        "16, 109-119 at 64; raise it on GPUs)."
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs each prediction actor asks Ray for.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per prediction actor.")
    concurrency: Concurrency = Field(1, description="Number of prediction actors." + AUTO_CONCURRENCY)


class TuneConfig(_LoraSection):
    """Zero-RAG's noise-tolerant tuning of the generator: each training question with relevant documents,
    with distracting documents, and with none."""

    RUNTIME_KEYS = frozenset({"enabled"})

    enabled: bool = Field(False, description="`wbrag run`: tune an adapter and evaluate with it.")
    docs_per_format: int | None = Field(
        None, ge=1, description="Documents in the relevant and distracting formats; None: retrieval.top_k, the "
        "count the evaluation's prompts hold (another count tells the tuned model which format it reads)."
    )
    retrieve_k: int = Field(
        10, ge=1, description="Documents retrieved per training question (at least retrieval.top_k): relevant "
        "documents and hard distractors (retrieved, without the answer) are picked from them."
    )
    weight_retrieval_free: float = Field(1.0, ge=0, description="Weight of the retrieval-free term (no documents).")
    weight_relevant: float = Field(1.0, ge=0, description="Weight of the retrieval-augmented term (relevant documents).")
    weight_noise: float = Field(1.0, ge=0, description="Weight of the noise-suppression term (distracting documents).")
    targets: Literal["gold", "own"] = Field(
        "gold", description="What each row is trained to answer: 'gold' (the first gold answer, as the paper) or "
        "'own' (the generator's own answer to the row's prompt where it holds a gold answer; a distracting row: its "
        "closed-book answer where that holds one; other rows dropped): for small models that answer in a sentence, "
        "whose accuracy a short gold target costs (noise_tolerant.own_targets)."
    )
    batch_size: int = Field(4, ge=1, description="Examples per optimizer step.")
    learning_rate: float = Field(3e-4, gt=0, description="AdamW learning rate (the paper's 3e-4).")
    max_length: int = Field(384, ge=8, description="Tokens per example (prompt + answer; prompts truncated left).")


class ZeroRagConfig(_Section):
    """Zero-RAG: mastery scores on a sample, a pruner, a corpus-wide percentile, router and tuning."""

    RUNTIME_KEYS = frozenset({"enabled"})

    enabled: bool = Field(
        False, description="`wbrag run`: after the index, score mastery, train the pruner(s), prune at every ratio "
        "and evaluate the grid (needs index.unit=sentence)."
    )
    sample: int = Field(2000, ge=1, description="Sentences sampled for mastery scoring.")
    seed: int = Field(0, description="Seed of the mastery sample and of the pruner's train / validation split.")
    qa_mode: Literal["cloze", "llm"] = Field(
        "cloze",
        description="How QA pairs are written: 'llm' (the QA generator writes them; chat prompts for instruct "
        "models, few-shot completion prompts for base models) or 'cloze' (deterministic: names, numbers and "
        "dates of the sentence are blanked; suits tiny models that write poor questions).",
    )
    qa_per_sentence: int = Field(3, ge=1, description="QA pairs per sampled sentence (n).")
    qa_generator: GeneratorConfig | None = Field(
        None, description="The model that writes QA pairs in llm mode (the paper: a strong LLM); None: the generator."
    )
    qa_max_new_tokens: int = Field(96, ge=8, description="llm mode: new-token budget for writing the QA pairs.")
    answer_max_new_tokens: int = Field(16, ge=1, description="The target model's closed-book answers: token budget.")
    mastery_metric: Literal["em", "acc"] = Field(
        "em", description="Per-pair score averaged into the mastery score: 'em' (the paper's exact match) or 'acc' "
        "(the answer occurs in the prediction: fairer to small models that answer in a sentence). Both are stored."
    )
    pruner: Literal["embedding", "lm"] = Field(
        "embedding", description="Which pruner predicts mastery for the corpus: 'embedding' (a head on the stored "
        "sentence vectors) or 'lm' (the LoRA LM regressor)."
    )
    train_pruners: list[Literal["embedding", "lm"]] = Field(
        default_factory=lambda: ["embedding"], description="Pruners `wbrag train-pruner` trains (and validates)."
    )
    val_fraction: float = Field(0.2, gt=0, lt=1, description="Held-out part of the scored sample.")
    head_hidden: int = Field(128, ge=0, description="Embedding head: hidden units (0: a linear head).")
    head_epochs: int = Field(200, ge=1, description="Embedding head: full-batch training epochs.")
    head_weight_decay: float = Field(1e-3, ge=0, description="Embedding head: AdamW weight decay.")
    lm_pruner: LMPrunerConfig = Field(default_factory=LMPrunerConfig)
    ratios: list[float] = Field(
        default_factory=lambda: [0.3], description="`wbrag run`: pruning ratios to build and evaluate (0 = full index)."
    )
    checkpoint_rows: int = Field(
        100_000, ge=1, description="Pruner prediction: about this many sentences per written block (= per file and "
        "per checkpoint commit): what a killed prediction pass can lose at most per task.",
    )
    histogram_bins: int = Field(
        4096, ge=16, description="Bins per level of the distributed percentile (two levels: 1/bins^2 resolution)."
    )
    train: str | None = Field(
        None, description="Labeled QA set for the query router and noise-tolerant tuning (FlashRAG jsonl / Parquet)."
    )
    train_limit: int | None = Field(None, ge=1, description="Use only the first N training questions.")
    router: bool = Field(False, description="`wbrag run`: train the query router and evaluate with it.")
    router_metric: Literal["acc", "em", "f1"] = Field(
        "acc", description="Router labels: a training question is 'mastered' when this metric of the generator's "
        "closed-book answer is > 0."
    )
    router_threshold: float = Field(
        0.5, gt=0, lt=1, description="Router: a query is 'mastered' (retrieval skipped) when P(correct) >= this."
    )
    tune: TuneConfig = Field(default_factory=TuneConfig)

    @field_validator("ratios")
    @classmethod
    def _ratios_in_range(cls, v: list[float]) -> list[float]:
        bad = [r for r in v if not 0 <= r < 1]
        if bad:
            raise ValueError(f"pruning ratios must be in [0, 1); got {bad}")
        return v


# The settings that may be "auto": section -> the count it sizes, of a pool of model actors (`concurrency`) or of a
# Ray Train worker group (`num_workers`), decided by `cluster_nodes.auto_concurrency`.
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
    # the counts that were "auto" before a command decided them (`cluster_nodes.resolve_auto_concurrency`): each
    # command decides them again, after what the commands before it built
    _auto_sections: frozenset[str] = PrivateAttr(default_factory=frozenset)
    # the GPU settings as the config said them before a command decided its "auto" ones (`cluster_nodes.
    # LAYOUT_SETTINGS`): None until one did
    _layout_said: dict[str, Any] | None = PrivateAttr(default=None)

    @field_validator("index")
    @classmethod
    def _factory_known(cls, v: IndexConfig) -> IndexConfig:
        if not v.factory.strip():
            raise ValueError("factory must be a faiss index factory string such as 'Flat' or 'IVF1024,Flat'")
        return v

    def fingerprint(self) -> dict[str, Any]:
        """The settings that decide a run's outputs (ray placement excluded), for change detection and run.json: the
        "auto" placement settings as the config said them, not what a command decided on its cluster (the next
        command, maybe on another cluster or after the index exists, decides them again)."""
        data = self.model_dump(mode="json")
        data.pop("ray", None)
        data.pop("run", None)
        said = {f"{key}.{AUTO_SETTINGS[key]}": "auto" for key in self._auto_sections}
        said.update(self._layout_said or {})
        for path, value in said.items():
            *parents, name = path.split(".")
            node = data
            for part in parents:
                node = node[part]
            node[name] = value
        return data


# --- loading -------------------------------------------------------------------------------------------


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_known_keys(ann, f"{prefix}{name}."))
        else:
            keys.append(f"{prefix}{name}")
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
        known = _known_keys(WbragConfig)
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "remove it; see `wbrag <cmd> --help` for keys"
        return f"unknown config key '{key}': {hint}"
    got = err.get("input")
    fix = err["msg"][0].lower() + err["msg"][1:]
    return f"config key '{key}' = {got!r} is invalid: {fix}"


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
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
        _set_dotted(tree, key, _override_value(key, raw))
    return tree


def _leaf_kinds(key: str) -> set[type] | None:
    """The types a dotted config key's field takes (None left out; Literal choices by their values' types), or
    None where the key names no field of the typed config (a section, a free-form mapping, a typo)."""
    import types
    import typing

    model: Any = WbragConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        origin = typing.get_origin(field.annotation)
        # a union's members are its options; list[str]'s argument is not (the value is a list)
        union = origin is typing.Union or origin is types.UnionType
        options = typing.get_args(field.annotation) if union or origin is Literal else (field.annotation,)
        if origin is Literal:
            return {type(v) for v in options}
        if i == len(parts) - 1:
            return {typing.get_origin(o) or o for o in options if o is not type(None)}
        model = next((o for o in options if isinstance(o, type) and issubclass(o, BaseModel)), None)
        if model is None:
            return None
    return None


def _override_value(key: str, raw: str) -> Any:
    """A --set value: text for a text setting (a name such as 2024 stays '2024'); else a YAML scalar, where a
    yes / no meant for a number is refused rather than read as 1 / 0."""
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
) -> WbragConfig:
    """Load YAML (optional), then apply `extra` (from CLI flags), then `--set` overrides, and validate once."""
    data: dict[str, Any] = {}
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
