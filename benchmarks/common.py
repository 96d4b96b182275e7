"""What every benchmark shares: arguments, timing, one-line figures, the matmul peak, demo data, a local Ray.

A figure is printed as one line, `name: value unit`, so runs can be compared with grep and diff. The machine is
shared and noisy: absolute numbers are context, the ratios measured within one run are the result.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import wbrag_ray
from wbrag_ray.formats import Passage, corpus_record
from wbrag_ray.models.hardware import cpu_matmul_flags

T = TypeVar("T")

DATA = Path(wbrag_ray.__file__).parent / "data"
DEMO_CORPUS = DATA / "demo_corpus.jsonl"
DEMO_QA = DATA / "demo_qa.jsonl"


# --- arguments and output -------------------------------------------------------------------------------


def parse_args(
    description: str, argv: Sequence[str] | None = None, rounds: tuple[int, int] = (1, 1)
) -> argparse.Namespace:
    """The flags every benchmark takes: `--quick`, and `--rounds` (default: rounds[0] full, rounds[1] quick)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a smaller workload (a smoke run, not a measurement)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"times each measurement is repeated; more rounds resist a busy machine (default {rounds[0]}, "
        f"quick {rounds[1]})",
    )
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = rounds[1] if args.quick else rounds[0]
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def header(name: str, args: argparse.Namespace) -> None:
    """Context lines: which benchmark, when, on how many cores, in which mode."""
    mode = "quick" if args.quick else "full"
    rounds = getattr(args, "rounds", None)  # a benchmark with its own parser may have no --rounds
    print(f"# benchmark {name} ({mode}{f', {rounds} round(s)' if rounds else ''})", flush=True)
    report("date", dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    report("nproc", os.cpu_count())
    report("cpu matmul flags", cpu_matmul_flags())
    report_pressure("before start")


def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 60 s in which some runnable task waited for a CPU (None where unavailable).

    Before a benchmark starts this is the neighbours' load; afterwards it includes the benchmark's own
    threads and Ray processes, so only a high value before the start marks a run as disturbed.
    """
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()
    except OSError:
        return None
    return float(dict(kv.split("=") for kv in some[1:])["avg60"])


def report_pressure(when: str) -> None:
    value = cpu_pressure()
    report(f"cpu pressure {when} (some, avg60)", "n/a" if value is None else value, "%" if value is not None else "")


def cpu_times() -> dict[str, int] | None:
    """The machine's CPU time since boot by kind (/proc/stat's first line, in ticks); None where unavailable."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), values, strict=False))


@contextmanager
def cpu_shares(what: str) -> Iterator[None]:
    """Print the shares of the machine's CPU time that went idle and to the hypervisor (steal) while the block
    ran: a run slowed by a neighbour on the same host shows steal, one slowed inside this machine shows no idle
    where its own work leaves some."""
    before = cpu_times()
    yield
    after = cpu_times()
    if before is None or after is None:
        return
    delta = {k: after[k] - before[k] for k in after}
    total = sum(delta.values()) or 1
    report(f"cpu idle during {what}", 100.0 * (delta["idle"] + delta["iowait"]) / total, "%")
    report(f"cpu steal during {what}", 100.0 * delta["steal"] / total, "%")


def report(name: str, value: Any, unit: str = "", digits: int = 1) -> Any:
    """Print one figure as `name: value unit` (floats with `digits` decimals) and return the value."""
    if isinstance(value, float):
        text = f"{value:,.{digits}f}"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    else:
        text = str(value)
    print(f"{name}: {text}{' ' + unit if unit else ''}", flush=True)
    return value


def report_ratio(name: str, numerator: float, denominator: float) -> float:
    """Print `name: N.NNNx`, the ratio of two figures measured in this run."""
    value = numerator / denominator if denominator else float("nan")
    print(f"{name}: {value:.3f}x", flush=True)
    return value


# --- timing ---------------------------------------------------------------------------------------------


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds` (wall clock, perf_counter)."""

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = float("nan")
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """(result, seconds) of one call of fn(*args, **kwargs)."""
    with Stopwatch() as sw:
        result = fn(*args, **kwargs)
    return result, sw.seconds


def set_up(model: T) -> tuple[T, float]:
    """(model, seconds its `setup()` took): the load time of an Embedder or a Generator."""
    _, seconds = timed(model.setup)
    return model, seconds


# --- compute ----------------------------------------------------------------------------------------------


def set_torch_threads(n: int) -> int:
    """Fix torch's intra-op threads (the default follows the machine, which hides what was measured)."""
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()


def matmul_peak_gflops(dtype: Any, n: int = 2048, seconds: float = 3.0, windows: int = 3) -> float:
    """Best GFLOP/s of `torch.matmul` on two n x n matrices of `dtype` over a few timed windows.

    The best window is the peak this machine reaches with the current torch threads; a shared machine only
    ever lowers a window, never raises it.
    """
    import torch

    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=c)  # first call picks and builds the kernel
    flops = 2.0 * n**3
    best = 0.0
    for _ in range(windows):
        iters, start = 0, time.perf_counter()
        while True:
            torch.matmul(a, b, out=c)
            iters += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / windows:
                break
        best = max(best, flops * iters / elapsed / 1e9)
    return best


# --- demo data --------------------------------------------------------------------------------------------


def demo_records() -> list[dict[str, Any]]:
    """The demo corpus as JSON objects ({"id", "contents"})."""
    return [json.loads(line) for line in DEMO_CORPUS.read_text().splitlines() if line.strip()]


def demo_passages() -> list[Passage]:
    """The demo corpus parsed the way ingest parses it (title split off the contents)."""
    passages = [corpus_record(obj) for obj in demo_records()]
    bad = [p for p in passages if isinstance(p, str)]
    if bad:
        raise RuntimeError(f"demo corpus has records ingest would reject: {bad[:3]}")
    return passages  # type: ignore[return-value]


def demo_questions() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DEMO_QA.read_text().splitlines() if line.strip()]


def demo_sentences() -> list[str]:
    """Every sentence of the demo passages, segmented by ingest's segmenter."""
    from wbrag_ray.config import IngestConfig
    from wbrag_ray.stages.ingest import Segmenter

    segmenter = Segmenter(IngestConfig().min_sentence_chars)
    return [s for p in demo_passages() for s in segmenter.split(p.text)]


def repeat_to(items: Sequence[T], n: int) -> list[T]:
    """`items` cycled to exactly n entries."""
    if not items:
        raise ValueError("nothing to repeat")
    return [items[i % len(items)] for i in range(n)]


def write_repeated_corpus(path: Path, n: int) -> int:
    """Write the demo corpus cycled to n records as jsonl, each copy with its own id; return the byte size."""
    records = demo_records()
    with path.open("w") as f:
        for i in range(n):
            rec = dict(records[i % len(records)])
            rec["id"] = f"{rec['id']}-r{i // len(records):05d}"
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return path.stat().st_size


_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an and are as at be by did does do for from has have how in is it its of on or the to was were what "
    "when where which who whom whose why with".split()
)


def keywords(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 2}


def keyword_top_k(question: str, passages: Sequence[Passage], k: int) -> list[int]:
    """Indices of the k passages sharing the most keywords with the question (ties: corpus order). No index."""
    q = keywords(question)
    overlap = [len(q & keywords(p.title + " " + p.text)) for p in passages]
    return sorted(range(len(passages)), key=lambda i: -overlap[i])[:k]


def demo_rag_prompts(n: int, k: int = 3) -> list[list[dict[str, str]]]:
    """n RAG chat prompts: the demo questions, each with its top-k demo passages by keyword overlap.

    Past the first pass over the questions, prompts carry k - 1 passages, so the copies differ in length.
    """
    from wbrag_ray.prompts import rag_messages
    from wbrag_ray.retrieval.hits import Hit

    questions, passages = demo_questions(), demo_passages()
    prompts = []
    for i in range(n):
        question = questions[i % len(questions)]["question"]
        top = keyword_top_k(question, passages, k if i < len(questions) else max(1, k - 1))
        hits = [Hit(id=j, score=0.0, rank=r, title=passages[j].title, text=passages[j].text) for r, j in enumerate(top)]
        prompts.append(rag_messages(question, hits))
    return prompts


# --- Ray ----------------------------------------------------------------------------------------------------


@contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """A private local Ray for this process only (never joins another cluster), shut down on the way out."""
    import logging

    import ray
    import ray.data

    # address="local" starts a fresh instance even when RAY_ADDRESS or a `ray start` cluster exists.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    try:
        yield
    finally:
        ray.shutdown()


def run_module_main(main: Callable[[Sequence[str] | None], int]) -> None:
    """`if __name__ == "__main__": run_module_main(main)`."""
    sys.exit(main(sys.argv[1:]))
