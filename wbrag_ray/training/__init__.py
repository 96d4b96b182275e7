"""LoRA (peft) training of Zero-RAG's two trained models: the LM pruner and the noise-tolerant generator."""
