"""The backends by `generator.backend` name, and `make_generator`, which picks one."""

from __future__ import annotations

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.generation.hf import HFGenerator
from wbrag_ray.generation.openai import OpenAIGenerator
from wbrag_ray.generation.types import Generator
from wbrag_ray.generation.vllm import VLLMGenerator
from wbrag_ray.models.bundled import resolve_model

BACKENDS: dict[str, type[Generator]] = {"hf": HFGenerator, "vllm": VLLMGenerator, "openai": OpenAIGenerator}


def make_generator(config: GeneratorConfig) -> Generator:
    """The generator for `config.backend`; checks the model spec now so a bad path fails before any job starts."""
    if config.backend not in BACKENDS:
        raise ConfigError(f"unknown generator.backend {config.backend!r}; choose one of {', '.join(BACKENDS)}")
    if config.backend != "openai":
        resolve_model(config.model)
    return BACKENDS[config.backend](config)
