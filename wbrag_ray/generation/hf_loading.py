"""Loading a causal LM with transformers (every role through `hf_model_source`: a GGUF file is converted once),
and sizing what one generate call may hold in memory."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from wbrag_ray.config import GeneratorConfig
from wbrag_ray.models.bundled import resolve_model
from wbrag_ray.storage import cache_root, node_cached, node_local_dir

log = logging.getLogger(__name__)


def hf_model_source(config: GeneratorConfig) -> str:
    """What `from_pretrained` takes for `config.model`: a local folder or a hub id; a GGUF file (de-quantized on
    every load) converted once per node to fp32 weights in a cache folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(config.model)
    path = Path(source)
    if path.suffix != ".gguf":
        return source

    def convert(tmp: str) -> None:
        import torch

        log.info("converting GGUF %s (first load on this node; cached at %s)", path, cached)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        # transformers refuses to save a model that carries its GGUF quantizer; the weights are de-quantized
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    # keyed by the GGUF file's path, size and time; the node's other loaders wait for the first one's copy
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = Path(config.cache_dir or cache_root()).expanduser() / "converted" / f"{path.stem}-{key}"
    return node_cached(str(cached), convert)


def load_hf_causal_lm(config: GeneratorConfig, dtype, device: str):
    """(model, tokenizer) from a local folder, a hub id, or a GGUF file (see `hf_model_source`), with the
    configured LoRA adapter (a local folder or an s3:// URI) merged in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = hf_model_source(config)
    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if config.lora_adapter:
        from peft import PeftModel

        # on this node: an s3:// adapter is fetched into this node's cache, never a path from the driver's
        model = PeftModel.from_pretrained(model, node_local_dir(config.lora_adapter))
        model = model.merge_and_unload()  # merged weights decode as fast as the base model
    model.to(device).eval()
    tok.padding_side = "left"  # decoder-only batches must end at the same position
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# On CPU a generate call of 8-16 RAG prompts runs as fast as one of 32 (a few thousand tokens already make the
# matrices wide; benchmarks/RESULTS.md, issue 75), while every row's KV cache stays resident: more rows cost memory.
CPU_CALL_BYTES = 512 << 20


def memory_budget(config: GeneratorConfig, device: str) -> int:
    """Bytes one generate call may use beyond the weights: generator.memory_gb, else 90% of the GPU memory
    left after loading, else CPU_CALL_BYTES within half of the node's available memory."""
    if config.memory_gb:
        return int(config.memory_gb * 2**30)
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0] * 0.9)
    return min(CPU_CALL_BYTES, int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5))


def row_bytes(model, tokens: int, new_tokens: int, with_probs: bool) -> int:
    """Estimated memory of one row of a generate call: its KV cache over prompt + new tokens, twice (a step grows
    the cache by concatenation: the old and the new tensors live together), the prefill's activations (hidden state
    and MLP), and the next-token logits (kept for every step when scoring)."""
    c = model.config
    size = model.dtype.itemsize
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    kv = 2 * c.num_hidden_layers * kv_heads * head_dim * size
    activations = 2 * (c.hidden_size + getattr(c, "intermediate_size", 4 * c.hidden_size)) * size
    logits = c.vocab_size * 4 * (new_tokens if with_probs else 2)
    return 2 * (tokens + new_tokens) * kv + tokens * activations + logits
