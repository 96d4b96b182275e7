"""The backends by `generator.backend` name, `make_generator`, which picks one, and `check_backend_mode`, which
refuses a pass the backend cannot run."""

from __future__ import annotations

from wbrag_ray.config import ConfigError, GeneratorConfig
from wbrag_ray.generation.hf import HFGenerator
from wbrag_ray.generation.openai import OpenAIGenerator
from wbrag_ray.generation.types import Generator, mixture_unsupported
from wbrag_ray.generation.vllm import VLLMGenerator
from wbrag_ray.models.bundled import resolve_model

BACKENDS: dict[str, type[Generator]] = {"hf": HFGenerator, "vllm": VLLMGenerator, "openai": OpenAIGenerator}


def make_generator(config: GeneratorConfig) -> Generator:
    """The generator for `config.backend`; checks the model spec now so a bad path fails before any job starts."""
    if config.backend not in BACKENDS:
        raise ConfigError(f"unknown generator.backend {config.backend!r}; choose one of {', '.join(BACKENDS)}")
    if config.backend != "openai":
        resolve_model(config.model, fetch=False)  # the workers that load it fetch it
    return BACKENDS[config.backend](config)


def check_backend_mode(config: GeneratorConfig, mode: str) -> None:
    """A `ConfigError` for a mixture pass (RePlug) on a backend that cannot decode one, before any model loads."""
    backend = BACKENDS.get(config.backend)
    if mode == "mixture" and backend is not None and not backend.supports_mixture:
        raise mixture_unsupported(config, backend.mixture_limit)
