"""Evaluation: a RAG method's answers on a QA dataset, scored (evaluate), and the methods x write-back grid
(methods_grid). The methods themselves live in wbrag_ray.rag."""
