"""WriteBack-RAG, one module per part: gates (and their sweep), distill (the distiller and its units), validation,
versions, and pipeline (`train_writeback`)."""
