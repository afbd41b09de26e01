"""The build: join captions to latents, embed them, drop bad rows (internal).

``prepare`` is the job's entry (find, pull or build the cache; every rank calls it);
``convert`` is the join, ``embed_stage`` the embedding stage, ``parts`` the parts and their
assembly, ``linked`` what a cache's marker records of the stored files it links and
their check, ``part_store`` the parts' identity and their store for every later cache,
``accounting`` the drop reasons and the report, ``shards`` and ``captions``
(with ``caption_sort`` and ``caption_bounds``) read and validate the inputs.

Internal: import the public API from ``hf_pipeline`` itself; these modules may move.
"""
