"""A small caption-conditioned latent denoiser in plain JAX (the demo's model).

Latents ``(B, 4, 32, 32)`` are cut into 4x4 patches (64 tokens of 64 values); each
token gets a learned position embedding, the projected caption embedding and a
noise-level embedding, goes through a residual MLP, and predicts the noise that was
added (epsilon prediction, cosine schedule). Small enough to train on 2 CPU cores
in a minute, yet it can only beat the unconditional loss by reading the caption.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["init_params", "loss_fn", "make_train_step", "make_optimizer"]

_P = 4  # patch size
_TOKENS = (32 // _P) ** 2
_PATCH_DIM = 4 * _P * _P


def _dense(key, fan_in: int, fan_out: int, scale: float = 1.0) -> dict[str, jax.Array]:
    w = jax.random.normal(key, (fan_in, fan_out), jnp.float32) * (scale / math.sqrt(fan_in))
    return {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}


def init_params(
    key: jax.Array, embed_dim: int, hidden: int = 256, depth: int = 2
) -> dict[str, Any]:
    """Random parameters for captions of ``embed_dim`` and a ``hidden``-wide MLP."""
    keys = jax.random.split(key, 4 + depth)
    return {
        "patch_in": _dense(keys[0], _PATCH_DIM, hidden),
        "cond": _dense(keys[1], embed_dim, hidden),
        "pos": jax.random.normal(keys[2], (_TOKENS, hidden), jnp.float32) * 0.02,
        "blocks": [
            {
                "l1": _dense(keys[4 + i], hidden, hidden),
                "l2": _dense(jax.random.fold_in(keys[4 + i], 1), hidden, hidden, 0.1),
            }
            for i in range(depth)
        ],
        "out": _dense(keys[3], hidden, _PATCH_DIM, 0.1),
    }


def _patchify(x: jax.Array) -> jax.Array:
    b = x.shape[0]
    x = x.reshape(b, 4, 32 // _P, _P, 32 // _P, _P)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(b, _TOKENS, _PATCH_DIM)


def _unpatchify(t: jax.Array) -> jax.Array:
    b = t.shape[0]
    t = t.reshape(b, 32 // _P, 32 // _P, 4, _P, _P)
    return t.transpose(0, 3, 1, 4, 2, 5).reshape(b, 4, 32, 32)


def _time_embedding(t: jax.Array, dim: int) -> jax.Array:
    half = dim // 2
    freqs = jnp.exp(-math.log(1000.0) * jnp.arange(half) / half)
    ang = t[:, None] * freqs[None, :] * 1000.0
    return jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], axis=-1)


def apply(params: dict[str, Any], x_t: jax.Array, t: jax.Array, emb: jax.Array) -> jax.Array:
    """Predict the noise in ``x_t`` at noise level ``t`` in [0, 1] given caption ``emb``."""
    lin = lambda p, h: h @ p["w"] + p["b"]  # noqa: E731
    h = lin(params["patch_in"], _patchify(x_t)) + params["pos"][None]
    hidden = h.shape[-1]
    cond = lin(params["cond"], emb) + _time_embedding(t, hidden)
    h = h + cond[:, None, :]
    for blk in params["blocks"]:
        h = h + lin(blk["l2"], jax.nn.gelu(lin(blk["l1"], jax.nn.gelu(h))))
    return _unpatchify(lin(params["out"], h))


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array], key: jax.Array) -> jax.Array:
    """Epsilon-prediction MSE under a cosine noise schedule (1.0 = predicting zeros)."""
    x0 = batch["latents"].astype(jnp.float32)
    emb = batch["embeddings"].astype(jnp.float32)
    k1, k2 = jax.random.split(key)
    t = jax.random.uniform(k1, (x0.shape[0],), minval=0.02, maxval=0.98)
    eps = jax.random.normal(k2, x0.shape, jnp.float32)
    alpha = jnp.cos(t * math.pi / 2)[:, None, None, None]
    sigma = jnp.sin(t * math.pi / 2)[:, None, None, None]
    x_t = alpha * x0 + sigma * eps
    pred = apply(params, x_t, t, emb)
    return jnp.mean((pred - eps) ** 2)


def make_optimizer(learning_rate: float, steps: int) -> optax.GradientTransformation:
    """AdamW with a short warm-up and cosine decay."""
    warmup = max(1, min(50, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1)
    )
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


def make_train_step(optimizer: optax.GradientTransformation):
    """A jitted ``(params, opt_state, batch, key) -> (params, opt_state, loss)``."""

    @jax.jit
    def step(params, opt_state, batch, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
