"""Generation: one interface, three backends (hf, vllm, openai), chosen by `generator.backend`.

- `types`: the prompt and answer types, the `Generator` interface, token-probability parsing;
- `hf_loading`: GGUF conversion cache, transformers model + tokenizer loading, memory budgeting;
- `hf`, `vllm`, `openai`: the backends; `backends`: `make_generator`, which picks one;
- `stage`: `GenerateStage`, a generator pass as a stage;
- `passes`: `generate_pass` (one pass over a Ray Dataset, any backend) and `GeneratorPasses` (passes recorded
  for stats, sharing one command's generator service).

Nothing is re-exported: import from the module that defines a name, so loading weights for training (which
needs `hf_loading` only) does not import the Ray stages.
"""
