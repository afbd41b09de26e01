"""The text encoder: tokenizer + model + pooling, batched on the accelerator (internal).

``model`` holds :class:`TextEncoder` and its compile modes; ``fusion`` the fused
bias + GELU. Internal: the public API is ``hf_pipeline``'s.
"""
