"""Vector indices: build from embedding shards, load from a manifest, search."""
