"""Where embeddings go: per-item records, the hand-off to transformers and vLLM, vLLM's encoder-cache items, Parquet,
and the link-safe file primitives every writer uses (``durable``)."""
