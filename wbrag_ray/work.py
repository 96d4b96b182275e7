"""The work a stage declares it will do, as data (`run.RunStage.work`): what `wbrag plan` prices and `wbrag run` does.
Counts come from the config and the plan's `Sizes`; a count the plan cannot know is None."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Sizes(Protocol):
    """The input sizes a declaration may ask the plan for."""

    passages: int | None
    sentences: int | None

    def units(self, unit: str) -> int | None:
        """Index units (passages or sentences) of the corpus."""

    def questions(self, path: str | None, limit: int | None) -> tuple[int | None, str]:
        """(questions in a QA file, how they were counted)."""

    def selection(self) -> tuple[float, float, str]:
        """Write-back's utility gate: (its keep rate, documents the document gate retains, where they come from)."""

    def tokens(self, what: str, docs: int = 0) -> float:
        """Mean tokens of a corpus "title", "sentence" or index "unit", or of a RAG "prompt" of `docs` units."""

    def figure(self, key: str) -> float:
        """A measured count the plan records (`plan.rates`), e.g. "cloze_calls_per_pair"."""


@dataclass(frozen=True)
class Pass:
    """Generator calls an item makes in one kind of prompt of `docs` documents. `mixture`: RePlug's group decoded as
    one answer; `prompt`: the builder of another prompt kind (of `prompt_docs` documents); `question`: "sentence"
    where the item is a corpus sentence; `kind`: a prompt kind calibration times."""

    calls: float
    docs: int
    new_tokens: int | None = None
    mixture: bool = False
    doc_tokens: float | None = None
    prompt: Callable | None = None
    prompt_docs: int = 0
    question: str | None = None
    kind: str | None = None


@dataclass(frozen=True)
class Generate:
    """`items` x each pass's calls on the generator service of config section `section`, beside the retrieval
    service when `retrieval`. `selection`: the passes depend on write-back's measured keep rate."""

    items: int | None
    passes: tuple[Pass, ...]
    describe: str
    retrieval: bool = False
    section: str = "generator"
    selection: bool = False


@dataclass(frozen=True)
class ReadCorpus:
    """The corpus parsed and split into passages and sentences by tasks."""

    passages: int | None


@dataclass(frozen=True)
class Embed:
    """`texts` index units (`unit`) embedded by the embedder's actors."""

    texts: int | None
    unit: str


@dataclass(frozen=True)
class AddVectors:
    """`vectors` added to a sharded index (trained here, or the full index's quantizer reused: `pruned_from`)."""

    vectors: int | None
    pruned_from: int | None = None


@dataclass(frozen=True)
class Train:
    """A Ray Train stage: `examples` rows of `row_tokens` under config section `section`. `first`: generator passes
    run before it (its targets); `head`: a small regression fit in the driver instead."""

    model: str
    section: str
    examples: int | None
    row_tokens: float = 0.0
    rows: str = ""
    first: Generate | None = None
    head: bool = False


@dataclass(frozen=True)
class Predict:
    """Every sentence's predicted mastery by pruner `kind` (tasks on stored vectors, or the LM's actors)."""

    sentences: int | None
    kind: str
    row_tokens: float = 0.0


@dataclass(frozen=True)
class Search:
    """`queries` searched for their top `k` on the retrieval service."""

    queries: int | None
    k: int
    describe: str
    title: str = ""  # a plan stage of its own, before the step's other work


Work = ReadCorpus | Embed | AddVectors | Generate | Train | Predict | Search
