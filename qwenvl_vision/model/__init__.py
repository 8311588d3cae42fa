"""The math: a family's config, its checkpoint names, the layers, attention, the tower skeleton and its two designs
(``qwen2_5``: windowed attention; ``qwen3``: learned position grid and DeepStack), and the per-instance cache."""
