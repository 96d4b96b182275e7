"""Zero-RAG, one module per step: sampling, qa, mastery, pruners, percentile, prune, tune, router and grid (the
evaluation over ratios x router x adapter x write-back). Each step is a declared RunStage; paths under
RUN/zero_rag/ are named in wbrag_ray.layout (ZeroRagFolder)."""
