"""WriteBack-RAG, one module per part of the method:

    gates:    the utility gate and the document gate (the paper's rules, and the stages that apply them)
    distill:  the two-step distiller (extract, then rewrite into one knowledge unit)
    units:    knowledge units with provenance, their embeddings, dedupe and Table 3
    versions: trained versions, the active one, replace and roll back
    pipeline: a labeled QA set -> a versioned write-back index beside the base (`train_writeback`)
"""
