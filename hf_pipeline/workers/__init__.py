"""The build's worker processes: a fork server of its own, never a fork of the
caller (``pool``; ``forkserver_init`` is what the server imports). Used by the build
and the demo. Internal.
"""
