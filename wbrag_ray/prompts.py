"""Prompts, in one place; the RAG prompts follow FlashRAG's defaults (answer only) so metrics are comparable."""

from __future__ import annotations

import json
from collections.abc import Sequence

from wbrag_ray.retrieval.hits import Hit

RAG_SYSTEM = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{reference}"
)
NO_RETRIEVAL_SYSTEM = (
    "Answer the question based on your own knowledge. Only give me the answer and do not output any other words."
)
QUESTION = "Question: {question}"


def conversation(system: str, *turns: str) -> list[dict[str, str]]:
    """A system message, then user and assistant turns by turns (solved examples), ending on the user's."""
    return [{"role": "system", "content": system},
            *({"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns))]


def format_reference(docs: Sequence[Hit]) -> str:
    return "\n".join(f"Doc {i + 1}(Title: {d.title}) {d.text}" for i, d in enumerate(docs))


def rag_messages(question: str, docs: Sequence[Hit]) -> list[dict[str, str]]:
    """Messages for answering with the given documents (none -> the no-retrieval prompt)."""
    if not docs:
        return no_retrieval_messages(question)
    return conversation(RAG_SYSTEM.format(reference=format_reference(docs)), QUESTION.format(question=question))


def no_retrieval_messages(question: str) -> list[dict[str, str]]:
    return conversation(NO_RETRIEVAL_SYSTEM, QUESTION.format(question=question))


def continue_answer(messages: list[dict[str, str]], answer_so_far: str) -> list[dict[str, str]]:
    """`messages` with the answer begun, for the generator to continue (FLARE)."""
    return [*messages, {"role": "assistant", "content": answer_so_far}] if answer_so_far else messages


# --- Self-RAG-style judgements: read as p("yes") against p("no") of the first token ---------------------
# Solved examples as earlier turns make a small model answer yes / no at all; the relevance examples end on a Yes,
# since ending on a No made it refuse every document (benchmarks/RESULTS.md).

JUDGE_CHOICES = ("yes", "no")
RETRIEVAL_JUDGE_SYSTEM = (
    "Decide whether you need to look up documents to answer the question correctly. Answer Yes if it asks for "
    "facts you do not know for certain, and No if you know the answer. Answer only Yes or No."
)
RETRIEVAL_JUDGE_SHOTS = (
    ("What is the capital of France?", "No"),
    ("Who was the chief engineer of the 1931 Mount Zhelezny railway tunnel?", "Yes"),
    ("How many legs does a spider have?", "No"),
    ("In which year was the Kalamazoo municipal library founded?", "Yes"),
)
RELEVANCE_JUDGE_SYSTEM = (
    "Decide whether the document is relevant to the question: answer Yes if it holds information that helps "
    "answer the question, and No if it does not. Answer only Yes or No."
)
RELEVANCE_JUDGE_USER = "Document (Title: {title}) {text}\n\nQuestion: {question}"
RELEVANCE_JUDGE_SHOTS = (
    ("Violin", "The violin is a string instrument with four strings tuned in perfect fifths.",
     "Into which sea does the Nile flow?", "No"),
    ("Nile", "The Nile flows north through eleven countries and empties into the Mediterranean Sea.",
     "Into which sea does the Nile flow?", "Yes"),
)


def retrieval_judge_messages(question: str) -> list[dict[str, str]]:
    """Self-RAG's 'Retrieve?' judgement as a prompt."""
    shots = [turn for q, answer in RETRIEVAL_JUDGE_SHOTS for turn in (QUESTION.format(question=q), answer)]
    return conversation(RETRIEVAL_JUDGE_SYSTEM, *shots, QUESTION.format(question=question))


def relevance_judge_messages(question: str, doc: Hit) -> list[dict[str, str]]:
    """Self-RAG's 'IsRel' judgement of one retrieved document as a prompt."""
    shots = [turn for title, text, q, answer in RELEVANCE_JUDGE_SHOTS
             for turn in (RELEVANCE_JUDGE_USER.format(title=title, text=text, question=q), answer)]
    return conversation(RELEVANCE_JUDGE_SYSTEM, *shots,
                RELEVANCE_JUDGE_USER.format(title=doc.title, text=doc.text, question=question))


def dumps(messages: list[dict[str, str]]) -> str:
    """Prompts travel through Ray Data as JSON strings (one column, any number of messages)."""
    return json.dumps(messages, ensure_ascii=False)


# --- WriteBack-RAG's distiller: two steps, and neither ever sees the gold answer -------------------------

EXTRACT_SYSTEM = (
    "You are given documents and a question. Copy, word for word, the sentences of the documents that help "
    "answer the question. Output only the copied sentences, one per line, and nothing else."
)
EXTRACT_USER = "Documents:\n{reference}\n\nQuestion: {question}"
REWRITE_SYSTEM = (
    "Rewrite the given sentences as one short, self-contained encyclopedia entry about the topic of the question. "
    "Write a title on the first line and the text on the second line. Use only facts from the sentences. State "
    "the facts themselves: do not mention the question or its answer."
)
REWRITE_USER = "Question: {question}\n\nSentences:\n{sentences}"


def extract_messages(question: str, docs: Sequence[Hit]) -> list[dict[str, str]]:
    """Distiller step 1: the answer-relevant sentences of the kept documents, verbatim."""
    return conversation(EXTRACT_SYSTEM, EXTRACT_USER.format(reference=format_reference(docs), question=question))


def rewrite_messages(question: str, sentences: str) -> list[dict[str, str]]:
    """Distiller step 2: the extracted sentences as one compact document (title line, then text)."""
    return conversation(REWRITE_SYSTEM, REWRITE_USER.format(question=question, sentences=sentences))


# --- Zero-RAG's mastery score: writing QA pairs, and answering them closed-book -------------------------

QA_WRITE_SYSTEM = (
    "Write {n} question-answer pairs about the given sentence. Each question must make sense on its own, without "
    "the sentence. Each answer must be a short phrase copied exactly from the sentence. Output only the pairs, "
    "as lines 'Q: <question>' and 'A: <answer>'."
)
QA_WRITE_USER = "Sentence: {sentence}"
# Few-shot completion prompt for base models (no chat template): two solved examples, then the sentence.
QA_FEWSHOT = (
    "Write questions whose answers are copied from the sentence.\n\n"
    "Sentence: The Eiffel Tower was completed in 1889 for the World's Fair in Paris.\n"
    "Q: In what year was the Eiffel Tower completed?\nA: 1889\n"
    "Q: In which city was the 1889 World's Fair held?\nA: Paris\n\n"
    "Sentence: Marie Curie was the first woman to win a Nobel Prize.\n"
    "Q: Who was the first woman to win a Nobel Prize?\nA: Marie Curie\n\n"
    "Sentence: {sentence}\nQ:"
)
# What a base model's completion continues: prepended to its output before parsing.
QA_FEWSHOT_PREFIX = "Q:"
CLOZE_SYSTEM = (
    "Fill in the blank (____) in the text from your own knowledge. Only give me the missing words and do not "
    "output any other words."
)
CLOZE_USER = "Text: {question}"
# Solved examples as earlier turns: more answers hold the blanked span (benchmarks/RESULTS.md).
CLOZE_SHOTS = (
    ("Eiffel Tower: The Eiffel Tower is a wrought-iron tower in ____, France.", "Paris"),
    ("World War II: World War II ended in ____.", "1945"),
    ("Romeo and Juliet: ____ wrote the play Romeo and Juliet.", "William Shakespeare"),
)


def qa_write_messages(sentence: str, n: int, chat: bool) -> list[dict[str, str]]:
    """Messages asking the QA generator for `n` pairs about `sentence` (chat) or a few-shot prompt (base)."""
    if not chat:
        return [{"role": "user", "content": QA_FEWSHOT.format(sentence=sentence)}]
    return conversation(QA_WRITE_SYSTEM.format(n=n), QA_WRITE_USER.format(sentence=sentence))


def closed_book_messages(question: str, cloze: bool) -> list[dict[str, str]]:
    """The target model's closed-book prompt for one QA pair (a cloze text, or a question)."""
    if cloze:
        shots = [turn for text, answer in CLOZE_SHOTS for turn in (CLOZE_USER.format(question=text), answer)]
        return conversation(CLOZE_SYSTEM, *shots, CLOZE_USER.format(question=question))
    return no_retrieval_messages(question)
