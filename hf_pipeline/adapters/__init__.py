"""Other clients of the cache: PyTorch and Lightning (``torch_data``), Grain
(``grain_source``) (internal: the public API is ``hf_pipeline``'s).
"""
