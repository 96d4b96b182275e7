"""WriteBack-RAG, one module per part: gates, distill, units, versions, and pipeline (`train_writeback`)."""
