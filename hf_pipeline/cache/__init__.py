"""The cache's on-disk format, shared by its writers and readers (internal).

``layout`` is the cache identity (fingerprint) and folder layout, and opens a complete
cache; ``precision`` and ``latents`` say how latents are stored (dtypes, bfloat16 bits).
Internal: the public API is ``hf_pipeline``'s.
"""
