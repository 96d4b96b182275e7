"""An independent reference for the generator's scored answers: greedy decoding written out by hand, one
unpadded prompt at a time, the model called once per step (its own KV cache; no batching, no padding, no
`generate`, no transition scores), each token's probability read from a full softmax of that step's logits.
The prompt is rendered by the tokenizer's own chat template."""

from __future__ import annotations


def stop_ids(model, tokenizer, stop=("\n",)) -> set[int]:
    """End-of-sequence ids and every token whose text holds a stop string."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    ids_all = sorted(tokenizer.get_vocab().values())
    for i, text in zip(ids_all, tokenizer.batch_decode([[i] for i in ids_all]), strict=True):
        if any(s in text for s in stop):
            ids.add(i)
    return ids


def greedy(model, tokenizer, messages, max_new_tokens: int, stops: set[int]) -> tuple[list[str], list[float], bool]:
    """(tokens, their probabilities, finished) of the greedy answer to `messages`: the stop token ends it and is
    not part of it."""
    import torch

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    tokens, probs, past = [], [], None
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        p = torch.softmax(out.logits[0, -1].float(), dim=-1)
        t = int(p.argmax())
        if t in stops:
            return tokens, probs, True
        tokens.append(tokenizer.decode([t]))
        probs.append(float(p[t]))
        ids = torch.tensor([[t]])  # the cache holds the rest
    return tokens, probs, False


def first_token_probs(model, tokenizer, messages) -> torch.Tensor:  # noqa: F821
    """The distribution of an answer's first token (a full softmax over the vocabulary)."""
    import torch

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        return torch.softmax(model(input_ids=ids).logits[0, -1].float(), dim=-1)


def load(path: str):
    """(model, tokenizer) of a local model folder, fp32, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)
