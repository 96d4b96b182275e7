"""Zero-RAG, one module per step, in the order of the method: find the sentences the model already knows, and
prune them from the index.

    sampling:   a uniform, seeded sample of sentences (the same on any number of nodes)
    qa:         QA pairs of a sentence (cloze blanks or written by an LLM), parsed and scored
    mastery:    sample -> QA pairs -> the target model's closed-book answers -> mean EM per sentence
    pruners:    embedding head and / or LoRA LM regressor, trained on the scored sample, validated on a held-out part
    percentile: the corpus-wide cut (two-level histogram, only counts travel) and the keep mask
    prune:      every sentence's predicted mastery; per ratio the keep mask, pruned corpus and pruned index
    tune:       noise-tolerant LoRA tuning of the generator (relevant / distracting / no documents)
    router:     P(the generator answers without retrieval) from the query; mastered queries skip retrieval
    grid:       evaluation over pruning ratios x router x adapter x write-back, with latency and index size

The paths under RUN/zero_rag/ are named in wbrag_ray.layout (ZeroRagFolder). Each stage is a declared RunStage:
its settings never count as a changed run config; a complete stage refuses to be reused with others (pass
--force to redo it and the stages after it).
"""

from __future__ import annotations
