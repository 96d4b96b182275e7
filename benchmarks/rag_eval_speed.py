"""A local naive-RAG evaluation as a researcher runs it, whole: `wbrag eval` commands timed from start to exit
(Ray's start and the model loads included), with the memory of every process they start.

The knowledge base is built once (ingest, embed, index with the defaults) on 100-word passages
(`benchmarks.long_passages`: the demo texts in overlapping windows, about 600 passages), or with `--data demo` on
the demo's own 100 passages; the questions are the
demo's 40 and its 120 held-out ones (160). Each variant then answers them with naive RAG (K = 5, the bundled
models, greedy), and adds the closed-book rows under the same name (`--methods no-retrieval`: only those rows are
answered). Variants:

    defaults    the settings as shipped
    baseline    the shipped defaults of 2026-12-07, set explicitly (`--baseline`): hf, one generator thread,
                calls of up to 32 prompts
    threads-2   the defaults with generator.threads=2 (both cores of this machine)
    vllm        the defaults with generator.backend=vllm (where vLLM's CPU build is installed: `make setup-vllm`)

Memory is the peak, over the command's run, of the resident set summed over its process tree (the driver, the
local Ray cluster it starts, every worker), polled every 0.2 s; `/usr/bin/time` would see the driver alone. The
largest single process is printed beside it. Prefill utilization: the prompts' tokens x 2 x the generator's
parameters, over the answer pass's seconds, against the matmul peak measured here in the generator's dtype.

    python -m benchmarks.rag_eval_speed [--quick] [--data long|demo] [--baseline] [--variants defaults,threads-2,vllm]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    DATA,
    DEMO_CORPUS,
    demo_passages,
    header,
    matmul_peak_gflops,
    report,
    report_ratio,
)
from benchmarks.long_passages import build

# the defaults of 2026-12-07 (issue 75's "today"): one generator thread, calls of up to 32 rows (the memory
# budget then was half the node's free memory, which 32 rows never reached)
BASELINE = ["generator.backend=hf", "generator.threads=1", "generator.memory_gb=8"]
VARIANTS = {"defaults": [], "baseline": BASELINE, "threads-2": ["generator.threads=2"],
            "vllm": ["generator.backend=vllm"]}
QUICK_QUESTIONS = 40


class TreeMemory:
    """Peak resident set summed over a process and its descendants, and the largest one (GB), polled."""

    def __init__(self, pid: int):
        import psutil

        self.root = psutil.Process(pid)
        self.total = self.largest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                break
            sizes = []
            for p in procs:
                try:
                    sizes.append(p.memory_info().rss / 1e9)
                except psutil.Error:
                    continue
            if sizes:
                self.total, self.largest = max(self.total, sum(sizes)), max(self.largest, max(sizes))
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wbrag(*args: str) -> tuple[float, TreeMemory, str]:
    """Run one `wbrag` command in a process of its own (its own local Ray cluster): seconds, memory, stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "wbrag_ray.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "RAY_ADDRESS": ""})
    memory = TreeMemory(proc.pid)
    out, err = proc.communicate()
    memory.stop()
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"wbrag {' '.join(args)} failed ({proc.returncode}):\n{err[-3000:]}")
    return seconds, memory, out


def prompt_tokens(predictions: Path) -> int:
    """Tokens of the prompts the generator prefilled (the bundled generator's chat template)."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.hf_loading import hf_model_source

    tokenizer = AutoTokenizer.from_pretrained(hf_model_source(GeneratorConfig()))
    rows = pq.read_table(predictions, columns=["prompt"]).column("prompt").to_pylist()
    texts = [tokenizer.apply_chat_template(json.loads(p), add_generation_prompt=True, tokenize=False) for p in rows]
    return sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_QUESTIONS} questions (a smoke run)")
    parser.add_argument("--baseline", action="store_true", help="also run the defaults of 2026-12-07")
    parser.add_argument("--data", choices=("long", "demo"), default="long",
                        help="long: 100-word passages (benchmarks.long_passages, the default); demo: the demo corpus")
    parser.add_argument("--variants", default=None, help="comma-separated, of: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    header("rag_eval_speed", args)
    names = args.variants.split(",") if args.variants else ["defaults", *(["baseline"] if args.baseline else []),
                                                             "threads-2", "vllm"]
    if "vllm" in names and importlib.util.find_spec("vllm") is None:
        report("vllm", "not installed (make setup-vllm): variant skipped")
        names.remove("vllm")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="rag-eval-speed-") as tmp:
        data, run = Path(tmp) / "data", Path(tmp) / "run"
        if args.data == "demo":  # the demo's own 100 passages of about 55 words
            data.mkdir()
            corpus = data / "corpus.jsonl"
            corpus.write_text(DEMO_CORPUS.read_text())
            words = [len(p.text.split()) for p in demo_passages()]
            counts = {"passages": len(words), "mean_words": sum(words) / len(words)}
        else:
            counts = build(data)
        questions = [json.loads(line) for name in ("demo_qa.jsonl", "demo_heldout.jsonl")
                     for line in (DATA / name).read_text().splitlines() if line.strip()]
        questions = questions[:QUICK_QUESTIONS] if args.quick else questions
        qa = data / "questions.jsonl"
        qa.write_text("".join(json.dumps(q) + "\n" for q in questions))
        report("passages", counts["passages"])
        report("mean words a passage", counts["mean_words"])
        report("questions", len(questions))
        kb = 0.0
        for command in (["ingest", str(run), "--corpus", str(data / "corpus.jsonl")], ["embed", str(run)],
                        ["index", str(run)]):
            seconds, memory, _ = wbrag(*command)
            kb += seconds
            report(f"{command[0]} seconds", seconds, "s")
        report("knowledge base seconds", kb, "s")
        results = {}
        for name in names:
            sets = [arg for s in VARIANTS[name] for arg in ("--set", s)]
            common = ["eval", str(run), "--dataset", str(qa), "--name", name, *sets]
            naive_s, naive_mem, _ = wbrag(*common, "--methods", "naive")
            closed_s, closed_mem, _ = wbrag(*common, "--methods", "no-retrieval")
            result = run / "eval" / f"{name}-naive"
            metrics = json.loads((result / "metrics.json").read_text())
            results[name] = {"naive_s": naive_s, "stage_s": metrics["seconds"], "acc": metrics["acc"],
                             "gb": naive_mem.total, "largest_gb": naive_mem.largest, "closed_s": closed_s,
                             "closed_gb": closed_mem.total,
                             "closed_acc": json.loads((run / "eval" / f"{name}-no-retrieval" / "metrics.json")
                                                      .read_text())["acc"],
                             "tokens": prompt_tokens(result / "predictions.parquet")}
            r = results[name]
            report(f"{name}: naive eval seconds (command)", r["naive_s"], "s")
            report(f"{name}: naive answer pass seconds (the stage)", r["stage_s"], "s")
            report(f"{name}: naive acc", r["acc"], "", 3)
            report(f"{name}: naive peak memory, process tree", r["gb"], "GB", 2)
            report(f"{name}: naive peak memory, largest process", r["largest_gb"], "GB", 2)
            report(f"{name}: no-retrieval added under the same name, seconds", r["closed_s"], "s")
            report(f"{name}: no-retrieval acc", r["closed_acc"], "", 3)
            report(f"{name}: no-retrieval peak memory, process tree", r["closed_gb"], "GB", 2)
            report(f"{name}: naive prompt tokens", r["tokens"])
    import torch

    from wbrag_ray.models.hardware import cpu_supports_bf16

    dtype = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    peak = report(f"matmul peak ({str(dtype).removeprefix('torch.')})", matmul_peak_gflops(dtype), "GFLOP/s")
    params = 134.5e6  # SmolLM2-135M-Instruct's parameters (tied embeddings counted once)
    for name, r in results.items():
        gflop = 2 * params * r["tokens"] / 1e9
        report(f"{name}: prefill work at the matmul peak", gflop / peak, "s")
        report_ratio(f"{name}: prefill utilization (work at peak / answer pass)", gflop / peak, r["stage_s"])
    if "defaults" in results:
        for name in results:
            if name != "defaults":
                report_ratio(f"{name} / defaults, naive eval seconds", results[name]["naive_s"],
                             results["defaults"]["naive_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
