"""LoRA training of Zero-RAG's LM pruner and noise-tolerant tuning, with the real bundled SmolLM2-135M."""

import json
import signal
import time

import numpy as np
import pandas as pd
import pytest

from tests.ray_actors import live_actor_ids
from wbrag_ray.config import GeneratorConfig, LMPrunerConfig, TuneConfig
from wbrag_ray.metrics import normalize_answer
from wbrag_ray.prompts import no_retrieval_messages, rag_messages
from wbrag_ray.retrieval.hits import Hit, hits_from_json, hits_to_json
from wbrag_ray.training.lm_pruner import LMPrunerPredictor, train_lm_pruner
from wbrag_ray.training.noise_tolerant import (
    IGNORE,
    build_examples,
    encode_example,
    own_targets,
    tune_generator,
)

# One torch thread: with two, a test that shares the 2 cores with any other busy process runs about 10x
# slower (OpenMP threads spin-wait for each other); with one, about 1.6x slower on an idle machine.
THREADS = 1

# Famous facts (mastered) against invented ones (not): a split the backbone's features can separate.
KNOWN = [
    "Paris is the capital of France.", "The Earth orbits the Sun.", "Water boils at 100 degrees Celsius at sea level.",
    "The Pacific is the largest ocean on Earth.", "William Shakespeare wrote Hamlet.", "The Moon orbits the Earth.",
    "Berlin is the capital of Germany.", "Albert Einstein developed the theory of relativity.",
]
UNKNOWN = [
    "Orvanth Pellik was mayor of Dressholm from 1873 to 1879.", "The Quillary Stakes were first run at Mobberton in 1911.",
    "Zentra Hallow sang soprano in the Vellin Chorale.", "The 1954 Karvosk by-election was won by Idris Melnow.",
    "Tobrek Fen covers 412 hectares near Ulsby Marsh.", "The Gantry Lane tram depot closed in 1962 after a fire.",
    "Sellwyn Ardo played 14 matches for Cradock Rovers.", "Pimsey Brook joins the River Adle at Nether Cawley.",
]


@pytest.mark.slow
def test_lm_pruner_learns_on_two_ray_train_workers_and_predicts_in_input_order(tmp_path, ray_cluster):
    texts, scores = KNOWN + UNKNOWN, [1.0] * len(KNOWN) + [0.0] * len(UNKNOWN)
    config = LMPrunerConfig(epochs=3, batch_size=4, max_length=32, threads=THREADS, trainer={"num_workers": 2})
    controllers = live_actor_ids("TrainController")
    previous = signal.signal(signal.SIGINT, _callers_handler)
    try:
        stats = train_lm_pruner(texts, scores, config, str(tmp_path / "pruner"), val_texts=texts)
        # Ctrl-C is this process's own again (Ray Train's fit installs a handler that aborts its run), and the
        # finished run's controller ends (that handler held it)
        assert signal.getsignal(signal.SIGINT) is _callers_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 30
    while live_actor_ids("TrainController") - controllers:
        assert time.monotonic() < deadline, "the finished training's controller is still alive"
        time.sleep(0.1)

    losses = stats["losses"]
    assert stats["steps"] == len(losses) == 12 and stats["seconds"] > 0 and stats["examples_per_s"] > 0
    assert stats["workers"] == 2 and stats["device"] == "cpu" and stats["dtype"] == "float32"
    assert stats["examples_seen"] == 48 and stats["epochs_seen"] == 3.0 and stats["resumed_from_steps"] == []
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
    saved = json.loads((tmp_path / "pruner" / "pruner.json").read_text())
    assert saved["backbone"] == "bundled:smollm2" and saved["max_length"] == 32 and saved["losses"] == losses
    from safetensors import safe_open

    with safe_open(str(tmp_path / "pruner" / "adapter_model.safetensors"), "pt") as f:
        assert any(k.endswith("score.weight") for k in f.keys()), "the regression head must be saved"

    predictor = LMPrunerPredictor(str(tmp_path / "pruner"), batch_size=5)
    predictor.setup()
    pred = predictor.predict(texts)
    assert pred.dtype == np.float32 and pred.shape == (len(texts),)
    assert ((pred >= 0) & (pred <= 1)).all()
    assert pred[: len(KNOWN)].mean() > pred[len(KNOWN) :].mean() + 0.05, pred
    # the worker that trained it predicted the held-out texts with the unmerged adapter: the same figures
    np.testing.assert_allclose(stats["validation"], pred, atol=0.02)
    perm = np.random.default_rng(1).permutation(len(texts))
    np.testing.assert_allclose(predictor.predict([texts[i] for i in perm]), pred[perm], atol=0.02)
    assert predictor.predict([]).shape == (0,)

    # Right padding is safe: in fp32, a sentence predicts the same alone as inside a padded batch.
    exact = LMPrunerPredictor(str(tmp_path / "pruner"), batch_size=16, dtype="float32")
    exact.setup()
    batched = exact.predict(texts)
    alone = np.array([exact.predict([t])[0] for t in texts[::5]])
    np.testing.assert_allclose(alone, batched[::5], atol=1e-4)


def _callers_handler(signum, frame):
    raise KeyboardInterrupt


def _hits(*docs):
    return hits_to_json([Hit(i, 1.0 - r / 10, r, title, text) for r, (i, title, text) in enumerate(docs)])


QUESTIONS = pd.DataFrame([
    {"id": "q1", "question": "What is the capital of Iceland?", "golden_answers": ["Reykjavik"],
     "docs": _hits((1, "Iceland", "Reykjavik is the capital of Iceland."), (2, "Norway", "Oslo is the capital of Norway."))},
    {"id": "q2", "question": "Which river carved the Grand Canyon?", "golden_answers": ["Colorado River", "the Colorado"],
     "docs": _hits((4, "Nile", "The Nile flows north."), (3, "Grand Canyon", "The Colorado carved the Grand Canyon."))},
    {"id": "q3", "question": "Who painted the Mona Lisa?", "golden_answers": ["Leonardo da Vinci"],
     "docs": _hits((5, "Louvre", "The Louvre is a museum in Paris."), (6, "Mona Lisa", "Leonardo da Vinci painted it."))},
    # no retrieved doc holds the answer: no relevant row; both docs are hard distractors
    {"id": "q4", "question": "What is the largest planet?", "golden_answers": ["Jupiter"],
     "docs": _hits((7, "Saturn", "Saturn has rings of ice."), (8, "Mars", "Mars is called the Red Planet."))},
    {"id": "q5", "question": "An unlabeled question?", "golden_answers": [], "docs": _hits((9, "X", "x"))},
])


def _contains(hit, golds):
    return any(normalize_answer(g) in normalize_answer(f"{hit.title} {hit.text}") for g in golds)


def test_build_examples_one_row_per_term_with_the_answer_only_in_relevant_docs_and_hard_distractors():
    examples = build_examples(QUESTIONS, docs_per_format=2, seed=3)
    assert len(examples) == 3 * 3 + 2  # q4 has no relevant row (no retrieved doc holds its answer); q5 no gold
    pd.testing.assert_frame_equal(examples, build_examples(QUESTIONS, docs_per_format=2, seed=3))
    for q in QUESTIONS.itertuples():
        if not q.golden_answers:
            continue
        rows = examples[examples["id"] == q.id].set_index("format")
        assert set(rows["target"]) == {q.golden_answers[0]}
        own = [h.key for h in hits_from_json(q.docs)]
        distracting = hits_from_json(rows.loc["distracting", "docs"])
        if q.id == "q4":
            assert list(rows.index) == ["distracting", "none"]
            assert [h.id for h in distracting] == [7, 8] and rows.loc["distracting", "random_distractors"] == 0
        else:
            assert list(rows.index) == ["relevant", "distracting", "none"]
            relevant = hits_from_json(rows.loc["relevant", "docs"])
            # what naive RAG shows at K=2: the top 2 in rank order, a distractor among them where retrieved so
            assert [h.key for h in relevant] == own[:2] and any(_contains(h, q.golden_answers) for h in relevant)
            assert json.loads(rows.loc["relevant", "messages"]) == rag_messages(q.question, relevant)
            # the hard distractor (retrieved for this question, without the answer) first, then one drawn
            assert distracting[0].key in own and distracting[1].key not in own
            assert rows.loc["distracting", "random_distractors"] == 1
        assert len(distracting) == 2 and not any(_contains(h, q.golden_answers) for h in distracting)
        assert rows.loc["none", "n_docs"] == 0 and rows.loc["none", "docs"] == "[]"
        assert json.loads(rows.loc["none", "messages"]) == no_retrieval_messages(q.question)
        assert json.loads(rows.loc["distracting", "messages"]) == rag_messages(q.question, distracting)


def test_formats_with_documents_hold_as_many_as_the_evaluation_so_the_count_does_not_tell_the_format():
    for k in (1, 2, 3):
        examples = build_examples(QUESTIONS, docs_per_format=k, seed=0)
        docs = examples[examples["format"] != "none"]
        assert set(docs["n_docs"]) == {k}, (k, docs[["id", "format", "n_docs"]])
    # K=1 and the answer retrieved at rank 2 only (q2): the doc that holds it, not the top one without it
    examples = build_examples(QUESTIONS, docs_per_format=1, seed=0).set_index(["id", "format"])
    assert [h.id for h in hits_from_json(examples.loc[("q2", "relevant"), "docs"])] == [3]
    assert [h.id for h in hits_from_json(examples.loc[("q1", "relevant"), "docs"])] == [1]


def test_own_targets_keep_the_generators_right_answers_and_give_distractors_its_closed_book_one():
    examples = build_examples(QUESTIONS, docs_per_format=2, seed=0)
    own = {("q1", "relevant"): "Reykjavik is the capital of Iceland.", ("q1", "distracting"): "Oslo.",
           ("q1", "none"): "The capital of Iceland is Reykjavik.",
           ("q2", "relevant"): "The Nile.", ("q2", "distracting"): "The Colorado.", ("q2", "none"): "I do not know.",
           ("q3", "relevant"): "Leonardo da Vinci painted it.", ("q3", "distracting"): "", ("q3", "none"): "Picasso.",
           ("q4", "distracting"): "Jupiter.", ("q4", "none"): "Saturn."}
    golds = {q.id: list(q.golden_answers) for q in QUESTIONS.itertuples()}
    kept = own_targets(examples, [own[(r.id, r.format)] for r in examples.itertuples()], golds)
    assert list(zip(kept["id"], kept["format"], kept["target"], strict=True)) == [
        ("q1", "relevant", "Reykjavik is the capital of Iceland."),
        # beside distractors: what it answers without them (its own distracting answer, right or wrong, is not used)
        ("q1", "distracting", "The capital of Iceland is Reykjavik."),
        ("q1", "none", "The capital of Iceland is Reykjavik."),
        ("q3", "relevant", "Leonardo da Vinci painted it."),
    ]
    assert list(kept.columns) == list(examples.columns)
    expected = examples.set_index(["id", "format"]).loc[list(zip(kept["id"], kept["format"], strict=True)), "messages"]
    assert kept["messages"].tolist() == expected.tolist()  # the prompts as built: only the targets change
    with pytest.raises(ValueError, match="answers for"):
        own_targets(examples, ["x"], golds)


def test_prompts_are_cut_from_the_left_so_the_answer_fits():
    from transformers import AutoTokenizer

    from wbrag_ray.generation.hf_loading import hf_model_source

    tok = AutoTokenizer.from_pretrained(hf_model_source(GeneratorConfig()))
    answer = tok("Reykjavik", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    prompt = "word " * 50 + "Question: What is the capital of Iceland?"
    ids, labels, cut = encode_example(tok, prompt, answer, max_length=16)
    assert len(ids) == len(labels) == 16 and cut > 0
    assert ids[-len(answer):] == answer and labels[-len(answer):] == answer
    assert labels[: 16 - len(answer)] == [IGNORE] * (16 - len(answer))
    assert tok.decode(ids[: 16 - len(answer)]).endswith("Iceland?")
    ids, labels, cut = encode_example(tok, "Short?", answer, max_length=64)
    assert cut == 0 and len(ids) < 64


@pytest.mark.slow
def test_noise_tolerant_tuning_on_two_ray_train_workers_lowers_loss_and_loads_in_the_generator(tmp_path, ray_cluster):
    import torch
    from transformers import AutoModelForCausalLM

    from wbrag_ray.generation.hf import HFGenerator
    from wbrag_ray.generation.hf_loading import hf_model_source

    examples = build_examples(QUESTIONS, docs_per_format=2, seed=0)
    # 11 examples in batches of 4: 3 steps an epoch, 6 steps in 2 epochs
    config = TuneConfig(epochs=2, batch_size=4, max_length=128, learning_rate=1e-3, threads=THREADS,
                        trainer={"num_workers": 2})
    out = str(tmp_path / "adapter")
    stats = tune_generator(examples, GeneratorConfig(), config, out)

    losses = stats["losses"]
    assert stats["steps"] == 6 and np.mean(losses[-2:]) < 0.7 * np.mean(losses[:2]), losses
    assert stats["workers"] == 2 and stats["examples_seen"] == 24 and stats["truncated_prompts"] == 0
    assert stats["formats"] == {"relevant": 3, "distracting": 4, "none": 4} and stats["questions_without_relevant"] == 1
    assert json.loads((tmp_path / "adapter" / "tune.json").read_text())["losses"] == losses
    # the three terms of the objective, each recorded per step and falling
    terms = stats["term_losses"]
    assert set(terms) == {"relevant", "distracting", "none"}
    for term in terms.values():
        assert len(term["per_step"]) == 6 and term["last"] < term["first"]

    tuned = HFGenerator(GeneratorConfig(lora_adapter=out, max_new_tokens=8, dtype="float32"))
    tuned.setup()
    answers = tuned.generate([json.loads(m) for m in examples["messages"][:2]])
    assert len(answers) == 2 and all(isinstance(a, str) and a for a in answers)
    base = AutoModelForCausalLM.from_pretrained(hf_model_source(GeneratorConfig()), dtype=torch.float32)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(tuned.model.state_dict()[name], base.state_dict()[name]), "the adapter was not merged"
