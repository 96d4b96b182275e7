"""Generation: one interface (`types`), three backends (hf, vllm, openai; `backends`), a pass as a stage (`stage`)
and a command's passes on its generator service (`passes`). Nothing is re-exported: loading weights for training
(`hf_loading`) imports no Ray stage."""
