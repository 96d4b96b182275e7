"""What every backend shares: the prompt and answer types, the `Generator` interface, and prompts as text. A prompt
is a list of chat messages: instruct models get their chat template, base models (`chat_template: false`) the
contents joined; a prompt whose last message is the assistant's is continued (FLARE's next sentence).
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from wbrag_ray.config import ConfigError, GeneratorConfig

Prompt = list[dict[str, str]]
MODES = ("text", "scored", "choice", "mixture")

# top-k logprobs asked of an engine for a choice judgement (what it leaves out is reported as missing mass)
CHOICE_TOP_K = 20


def check_mode(mode: str, choices: tuple[str, ...]) -> None:
    """A clear error for a pass no backend can run, before any actor starts."""
    if mode not in MODES:
        raise ValueError(f"unknown generation mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "choice" and not choices:
        raise ValueError("a choice pass needs the choice words")


def mixture_unsupported(config: GeneratorConfig, why: str) -> ConfigError:
    """The error of a backend asked for a probability mixture it cannot decode."""
    return ConfigError(
        f"generator.backend={config.backend} cannot decode RePlug's probability mixture: {why}. Use "
        "generator.backend=hf for the RAG method replug, or the method replug-vote (a weighted vote over "
        "per-document answers) on this backend"
    )


def context_refusal(config: GeneratorConfig, prompt_tokens: int | str, new_tokens: int, context: int,
                    what: str = "the context of") -> ConfigError:
    """The error of a prompt the model cannot read whole with its answer (the answer would pass as a poor score).
    `prompt_tokens`: a count, or an engine's words ("at least 257"); `what`: which context."""
    tokens = f"{prompt_tokens:,}" if isinstance(prompt_tokens, int) else prompt_tokens
    return ConfigError(
        f"a prompt of {tokens} tokens plus {new_tokens} new tokens is longer than {what} generator.model "
        f"{config.model!r} ({context:,} tokens): lower retrieval.top_k (documents per prompt; under "
        "retrieval.union additive, top_k + retrieval.max_units) or ingest.max_passage_chars, or use a model with a "
        "longer context")


def mixture_weights(groups: list[list[Prompt]], weights: list[list[float]]) -> list[list[float]]:
    """Each group's weights summing to 1 (equal where they sum to nothing); an error for a group without prompts or
    with another count of weights."""
    if len(groups) != len(weights):
        raise ValueError(f"{len(groups)} prompt groups but {len(weights)} weight lists")
    out = []
    for i, (group, w) in enumerate(zip(groups, weights, strict=True)):
        if not group or len(group) != len(w):
            raise ValueError(f"mixture group {i}: {len(group)} prompts and {len(w)} weights (need as many, at least 1)")
        if any(x < 0 for x in w):
            raise ValueError(f"mixture group {i}: negative weight in {w}")
        total = float(sum(w))
        out.append([x / total for x in w] if total > 0 else [1 / len(w)] * len(w))
    return out


@dataclass
class Scored:
    """One greedy answer with the probability the model gave each of its tokens."""

    text: str  # the answer, cut at the stop strings
    tokens: list[str]  # the generated tokens before the end / stop token, as text
    probs: list[float]  # each token's probability when it was chosen
    finished: bool  # the model ended the answer itself (end or stop token), not the token budget


def scored_columns(output_column: str) -> tuple[str, ...]:
    """The columns a `scored` or `mixture` pass adds to a row: `Scored`'s fields, the text as `output_column`."""
    return (output_column, *(f"{output_column}_{f}" for f in ("tokens", "probs", "finished")))


class Generator(ABC):
    """Batched greedy generation. `setup()` loads the model (once per worker); `generate` answers prompts."""

    supports_mixture = False  # can decode a group of prompts as one answer from their mixed distributions
    mixture_limit = "this backend does not expose every prompt's next-token distribution at every step"

    def __init__(self, config: GeneratorConfig):
        self.config = config

    def setup(self) -> None:  # noqa: B027 - optional hook
        """Load weights; called once per worker, never at construction (the object travels to actors)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """End what `setup` started that this object's end would not end in order (an engine's processes)."""

    def with_config(self, config: GeneratorConfig) -> Generator:
        """This set-up generator under another pass's settings, the loaded model shared."""
        other = copy.copy(self)
        other.config = config
        return other

    @abstractmethod
    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        """Greedy answers, one per prompt, in order."""

    @abstractmethod
    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:
        """Greedy answers with their tokens' probabilities, one per prompt, in order."""

    def generate_mixture(
        self, groups: list[list[Prompt]], weights: list[list[float]], max_new_tokens: int | None = None
    ) -> list[Scored]:
        """One greedy answer per group of prompts (RePlug's ensemble): at each step the argmax of p(t) = sum_j w_j
        p_j(t) over the group's prompts is appended to all of them; `Scored.probs` are the mixture's."""
        raise mixture_unsupported(self.config, self.mixture_limit)

    @abstractmethod
    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        """For each prompt, the probability of each choice word as the answer's first token (not normalized)."""


# --- prompts and answers as text ---------------------------------------------------------------------------


def continues_answer(prompt: Prompt) -> bool:
    """A prompt ending with the assistant's message asks for that message's continuation."""
    return bool(prompt) and prompt[-1].get("role") == "assistant"


def messages_to_text(messages: Prompt) -> str:
    """Completion-style prompt for base models: the contents in order, the last one open for the answer."""
    return "\n\n".join(m["content"] for m in messages)


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The text before the first stop string (a backend may return the stop string and what its token held)."""
    text = text.strip()
    for s in stop:
        if s and s in text:
            text = text[: text.index(s)]
    return text.strip()


# --- token probabilities as engines and APIs report them ---------------------------------------------------


def choice_matches(token_text: str, choice: str) -> bool:
    """A vocabulary token counts as a choice word in any case and with any surrounding space ("Yes", " yes")."""
    return token_text.strip().lower() == choice.strip().lower()


def choice_mass(top: list[tuple[str, float]], choices: tuple[str, ...]) -> list[float]:
    """Probability of each choice from a first-token distribution given as (token text, probability) pairs
    (a backend's top-k): the tokens spelling the same word add up."""
    return [sum(p for t, p in top if choice_matches(t, c)) for c in choices]


def scored_from_pieces(pieces: list[tuple[str, float]], text: str, finished: bool, stop: list[str]) -> Scored:
    """A `Scored` answer from (token text, logprob) per generated token; tokens stop before the first that decodes
    to nothing (a special token) or holds a stop string."""
    tokens, probs = [], []
    for piece, logprob in pieces:
        if not piece or any(s and s in piece for s in stop):
            break
        tokens.append(piece)
        probs.append(math.exp(logprob))
    return Scored(cut_at_stop(text, stop), tokens, probs, finished)
