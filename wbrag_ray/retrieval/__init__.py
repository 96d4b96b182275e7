"""Retrieval: the document store, the search actors that hold an index's shards (the retrieval service), the
Ray Data stage that adds retrieved documents to a pass, and the in-process retriever for small jobs.

    hits        Hit, merging per-shard results into one top K, the `docs` column's JSON
    union       the base and write-back indices' hits into one top K (retrieval.union), a unit's provenance
    docstore    id -> (title, text) from memory-mapped, id-sorted Arrow files (never the corpus in memory)
    local       Retriever: an index searched in this process; IndexUnion: indices searched as one
    service     SearchPool / RetrievalService: shards in search actors (index.search), started once per command
    stage       RetrieveStage / RetrievalSetting: a retrieval pass over a Ray Dataset, on the service
"""
