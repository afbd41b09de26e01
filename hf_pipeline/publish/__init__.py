"""Publish once, pull anywhere (internal).

``upload`` publishes a complete cache (``--publish``), ``pull`` is the stage builds that
download one (``build.pull_from``), ``find`` reads a published cache back, checked,
``manifest`` the whole-file checksums. The ``gs://`` / ``hf://`` locations themselves
(listing, uploading) are each backend's write side, in :mod:`hf_pipeline.stores`.
Internal: the public API is ``hf_pipeline``'s.
"""
