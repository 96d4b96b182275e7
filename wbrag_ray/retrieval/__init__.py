"""Retrieval: the document store, the search actors that hold an index's shards (the retrieval service), the
Ray Data stage that adds retrieved documents to a pass, the in-process retriever, and the union of the base and
write-back indices (docs/architecture.md names each module)."""
