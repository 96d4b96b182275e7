"""Zero-RAG, one module per step: mastery (the sample and its QA pairs, from qa), pruners, prune (predictions, the
percentile, the pruned index), tune, router and grid (ratios x router x adapter x write-back). Each step is a
declared RunStage; paths under RUN/zero_rag/ are named in wbrag_ray.layout (ZeroRagFolder)."""
