"""Tiny models for the tests that check plumbing and decisions, not answer quality.

Each is the bundled model's architecture and tokenizer with a few narrow layers and random weights drawn with a
fixed seed, saved as an ordinary local model folder: the code under test loads it by path exactly as it loads a
real checkpoint (transformers / sentence-transformers `from_pretrained`), runs the same chat template, the same
batching, stop tokens, scoring and Ray passes, and spends a small fraction of the compute. On the slow CPU kind
(AVX2 only, fp32) the bundled 135M generator needs seconds per long RAG prompt; this one needs milliseconds.

The weights are drawn wider than a trained model's initialization (`initializer_range`), so next-token
distributions are peaked (greedy tokens at probability 0.05-0.7, not 1 / vocabulary): greedy answers, token
probabilities and yes / no judgements then differ from question to question and do not flip with batch
composition, which the tests' threshold decisions need.

Both are built once per test session (about 15 s, most of it reading the tokenizer out of the GGUF).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SEED = 0


@dataclass(frozen=True)
class TinyModels:
    generator: str  # local HF causal-LM folder (SmolLM2's tokenizer and chat template)
    embedder: str  # local sentence-transformers folder (MiniLM's tokenizer, mean pooling, normalized)
    embedder_dim: int

    def overrides(self, embedder: bool = True) -> list[str]:
        """`--set` overrides that put the run's generator roles (answers, LM pruner backbone) and, unless
        `embedder=False` (a test over an index built with the real embedder), its embedder on the tiny models,
        in fp32 whatever the CPU."""
        out = [f"generator.model={self.generator}", "generator.dtype=float32",
               f"zerorag.lm_pruner.backbone={self.generator}"]
        if embedder:
            out += [f"embedder.model={self.embedder}", "embedder.dtype=float32"]
        return out

    def set_args(self, embedder: bool = True) -> list[str]:
        """The same overrides as CLI arguments."""
        return [a for o in self.overrides(embedder) for a in ("--set", o)]

    def yaml(self, generator: str = "", embedder: str = "") -> str:
        """Config sections (YAML) with the tiny models; `generator` / `embedder` add indented keys of their own."""
        return (
            f"generator:\n  model: {self.generator}\n  dtype: float32\n{generator}"
            f"embedder:\n  model: {self.embedder}\n  dtype: float32\n{embedder}"
            f"zerorag:\n  lm_pruner:\n    backbone: {self.generator}\n"
        )


def build_tiny_generator(out: Path, **shape) -> str:
    """SmolLM2-135M-Instruct's config and tokenizer with 2 layers of width 64: about 3.2M parameters, nearly all
    of them the tied 49K-token embedding. Read from the bundled GGUF's converted copy (converted once per machine
    and shared with every test and demo that runs the bundled generator; reading the tokenizer out of the GGUF
    itself takes 20 s on a slow CPU). `shape`: other config values (vLLM's CPU attention takes head_dim 64)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from wbrag_ray.config import GeneratorConfig
    from wbrag_ray.generation.hf_loading import hf_model_source

    source = hf_model_source(GeneratorConfig())
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = AutoConfig.from_pretrained(source)
    config.update({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.5, **shape})
    config._name_or_path = "tiny-smollm2"
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def build_tiny_embedder(out: Path, dim: int = 32) -> str:
    """all-MiniLM-L6-v2's BERT config and tokenizer with 1 layer of width `dim`, mean pooling and normalization
    as in the bundled model."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import AutoConfig, AutoTokenizer, BertModel

    from wbrag_ray.models.bundled import bundled_path

    source = bundled_path("all-minilm-l6-v2")
    config = AutoConfig.from_pretrained(source)
    config.update({"num_hidden_layers": 1, "hidden_size": dim, "intermediate_size": 2 * dim,
                   "num_attention_heads": 4, "initializer_range": 0.5})
    torch.manual_seed(SEED)
    bert = BertModel(config)
    with torch.no_grad():
        # What every token shares (its segment embedding, most of its position embedding) would survive mean
        # pooling and make every pair of texts look alike; what is left is a bag of token vectors, so texts
        # sharing words come out closer than texts that don't.
        bert.embeddings.token_type_embeddings.weight.zero_()
        bert.embeddings.position_embeddings.weight.mul_(0.1)
    hf = out / "hf"
    bert.save_pretrained(hf)
    AutoTokenizer.from_pretrained(source).save_pretrained(hf)
    modules = [Transformer(str(hf), max_seq_length=128), Pooling(dim, "mean"), Normalize()]
    st = SentenceTransformer(modules=modules, device="cpu")
    st.save(str(out / "st"))
    return str(out / "st")


def build_tiny_models(root: Path) -> TinyModels:
    root.mkdir(parents=True, exist_ok=True)
    return TinyModels(build_tiny_generator(root / "generator"), build_tiny_embedder(root / "embedder"), 32)


def save_random_adapter(model: str, out: Path, lora_b_std: float = 0.0) -> Path:
    """A LoRA adapter on `model` (a local folder) saved as noise-tolerant tuning saves one (peft, the tune
    section's rank and target modules), without a training: for tests of how an adapter travels and is served,
    not of what it learned. `lora_b_std` > 0 draws the B matrices (zero after peft's initialization, where the
    adapter changes nothing) from N(0, std), seeded, so the adapter changes answers."""
    import torch
    from transformers import AutoModelForCausalLM

    from wbrag_ray.config import TuneConfig
    from wbrag_ray.training.lora import with_lora

    torch.manual_seed(SEED)
    peft_model = with_lora(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), TuneConfig(), "CAUSAL_LM")
    if lora_b_std:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, lora_b_std)
    peft_model.save_pretrained(out)
    return out
