"""A data folder of another shape than the demo's, made from what ships with the package (there is no network
here, so FlashRAG's wiki-18 cannot be fetched): `python -m benchmarks.long_passages OUT [--offsets 6]`.

    OUT/corpus.jsonl  100 x `offsets` passages of about 110-120 words (the demo's are about 55): passage (p, j)
                      is demo passage p's title and text followed by the text of demo passage p + j (mod 100),
                      j = 1..offsets; so each demo text leads `offsets` passages and trails `offsets` others, as
                      wiki-18's 100-word windows overlap, and a question's answer is in several passages
    OUT/train.jsonl   80 short-answer questions: the demo's 30 training questions, then the first 50 of the 120
                      held-out ones
    OUT/test.jsonl    40 short-answer questions: held-out questions 51-90, none of them a training question

`benchmarks.plan_accuracy --data OUT` points a config's corpus, write-back training set and test set at them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import DATA, demo_passages, report

TRAIN, TEST = 80, 40


def _qa(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


def build(out: Path, offsets: int = 6) -> dict[str, int]:
    """Write the folder; returns its counts."""
    out.mkdir(parents=True, exist_ok=True)
    passages = demo_passages()
    n = len(passages)
    with (out / "corpus.jsonl").open("w") as f:
        for i, p in enumerate(passages):
            for j in range(1, offsets + 1):
                tail = passages[(i + j) % n].text
                f.write(json.dumps({"id": f"long-{i:03d}-{j}", "contents": f"{p.title}\n{p.text} {tail}"}) + "\n")
    held = _qa("demo_heldout.jsonl")
    train = _qa("demo_train.jsonl") + held[:TRAIN - 30]
    test = held[TRAIN - 30:TRAIN - 30 + TEST]
    for name, rows in (("train", train), ("test", test)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = [len(line.split()) for line in (json.loads(x)["contents"] for x in (out / "corpus.jsonl").open())]
    return {"passages": n * offsets, "mean_words": round(sum(words) / len(words), 1), "train": len(train),
            "test": len(test)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--offsets", type=int, default=6, help="passages each demo text leads (100 x this in all)")
    args = parser.parse_args(argv)
    for key, value in build(Path(args.out), args.offsets).items():
        report(key, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
