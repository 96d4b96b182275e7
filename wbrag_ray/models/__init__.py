"""Model wrappers: embedder, bundled models, hardware choice, model sizes, pruner head and router."""
