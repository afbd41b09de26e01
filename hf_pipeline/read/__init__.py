"""Reading batches: the global sample order and the JAX loader (internal).

``mapped`` gathers rows from the memory-mapped Arrow files, ``records`` indexes them as
samples (one crop per record, or every crop), ``sampler`` is the global order per
(seed, epoch), ``loader`` the prefetching JAX loader. Internal: the public API
is ``hf_pipeline``'s.
"""
