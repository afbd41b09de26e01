"""Publish once, pull anywhere (internal).

``upload`` publishes a complete cache (``--publish``), ``pull`` is the stage builds that
download one (``build.pull_from``), ``find`` reads a published cache back, checked,
``stores`` are the ``gs://`` / ``hf://`` locations, ``manifest`` the whole-file checksums.
Internal: the public API is ``hf_pipeline``'s.
"""
