"""The build's worker processes: a fork server of its own, never a fork of the
caller (``pool``; ``forkserver_init`` is what the server imports). Used by the build
and the demo; the stream's workers (:mod:`hf_pipeline.read.stream.workers`) use its
lasting starter thread and ``die_with_parent``. Internal.
"""
