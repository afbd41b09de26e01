"""The demo trainer: a small caption-conditioned latent denoiser in JAX + optax
(``denoiser``) and its training loop (``loop``). Internal: use ``hf_pipeline.train``.
"""
