"""The backend for any OpenAI-compatible server (vLLM serve, TGI, llama.cpp server, hosted APIs): one HTTP
request per prompt, a few in flight at once."""

from __future__ import annotations

import json
import math
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from wbrag_ray.config import ConfigError
from wbrag_ray.generation.types import (
    CHOICE_TOP_K,
    Generator,
    Prompt,
    Scored,
    choice_mass,
    cut_at_stop,
    messages_to_text,
    scored_from_pieces,
)


class OpenAIGenerator(Generator):
    """/v1/chat/completions (/v1/completions without a chat template)."""

    mixture_limit = (
        "an OpenAI-compatible server decodes each request as its own sequence and returns at most the top 20 "
        "logprobs per token, so K requests cannot share one token chosen from their mixed distributions"
    )

    def setup(self) -> None:
        if not self.config.base_url:
            raise ConfigError("generator.backend=openai needs generator.base_url, e.g. http://host:8000/v1")
        self.api_key = os.environ.get(self.config.api_key_env, "")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.config.base_url.rstrip("/") + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    def _complete(self, p: Prompt, max_tokens: int, top_logprobs: int | None) -> tuple[str, list, bool]:
        """(text, [(token, logprob, top [(token, logprob)])], stopped by the model) for one prompt."""
        stop = {"stop": list(self.config.stop)} if self.config.stop else {}
        base = {"model": self.config.model, "temperature": 0, "max_tokens": max_tokens, **stop}
        if self.config.chat_template:
            extra = {"logprobs": True, "top_logprobs": top_logprobs} if top_logprobs is not None else {}
            choice = self._post("/chat/completions", {**base, "messages": p, **extra})["choices"][0]
            text = choice["message"]["content"] or ""
            steps = [(c["token"], c["logprob"], [(t["token"], t["logprob"]) for t in c.get("top_logprobs") or []])
                     for c in (choice.get("logprobs") or {}).get("content") or []]
        else:
            extra = {"logprobs": max(top_logprobs, 1)} if top_logprobs is not None else {}
            choice = self._post("/completions", {**base, "prompt": messages_to_text(p), **extra})["choices"][0]
            text = choice["text"]
            lp = choice.get("logprobs") or {}
            steps = [(t, v, list((top or {}).items())) for t, v, top in
                     zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or [], strict=False)]
        return text, steps, choice.get("finish_reason") == "stop"

    def _map(self, fn, prompts: list[Prompt]) -> list:
        with ThreadPoolExecutor(max_workers=min(16, len(prompts) or 1)) as pool:
            return list(pool.map(fn, prompts))

    def generate(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[str]:
        max_tokens = max_new_tokens or self.config.max_new_tokens
        return self._map(lambda p: cut_at_stop(self._complete(p, max_tokens, None)[0], self.config.stop), prompts)

    def generate_scored(self, prompts: list[Prompt], max_new_tokens: int | None = None) -> list[Scored]:
        max_tokens = max_new_tokens or self.config.max_new_tokens
        stop = list(self.config.stop)

        def one(p: Prompt) -> Scored:
            text, steps, stopped = self._complete(p, max_tokens, 0)
            return scored_from_pieces([(token, logprob) for token, logprob, _ in steps], text, stopped, stop)

        return self._map(one, prompts)

    def choice_probs(self, prompts: list[Prompt], choices: tuple[str, ...]) -> list[list[float]]:
        def one(p: Prompt) -> list[float]:
            _, steps, _ = self._complete(p, 1, CHOICE_TOP_K)
            top = steps[0][2] if steps else []
            return choice_mass([(t, math.exp(lp)) for t, lp in top], tuple(choices))

        return self._map(one, prompts)

