"""Generate a small demo dataset in exactly the real COYO latent-release format.

Shards ``000000-000499.pt`` hold ``{"keys": int64 (N,), "latents": (N, 3, 4, 32, 32)}``
and ``coyo11m-meta.parquet`` holds ``key, caption_llava, caption, caption_llava_short,
url``. Captions describe a synthetic scene, "a {color} {shape} on a {background}
background, {style}", and the words shape the latents: the colour sets per-channel means
inside the shape's mask, the shape sets the mask, the background sets the outside mean,
the style sets the texture. So a caption-conditioned model has something to learn.

The defects real data has are planted and counted in :class:`DemoData`: latent keys with
no metadata row, metadata rows with no latents, null, empty and whitespace-only
captions, a key present in two shards, and a duplicated metadata row.

Generation is deterministic (same parameters -> byte-identical files, whatever
``num_proc``: each shard's latents come from an RNG stream of its own, so the shards can
be written by a pool of processes) and safe when many processes call it on the same
folder at once: each writes a private temp folder next to the target and renames it into
place; the loser discards its copy.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, cast

import numpy as np

from dist.atomic import atomic_write, fsync_dir
from hf_pipeline.errors import SourceError

__all__ = [
    "BACKGROUNDS",
    "COLORS",
    "METADATA_NAME",
    "SHAPES",
    "STYLES",
    "DemoData",
    "generate_demo",
]

#: File name of the generated metadata parquet (as in the real release).
METADATA_NAME = "coyo11m-meta.parquet"
_MANIFEST_NAME = "manifest.json"
_FORMAT_VERSION = 1
_SIZE = 32
# Brings the overall std to about 1, like SD-VAE latents times their scaling factor.
_SCALE = 1.35

#: Colour word -> mean of the 4 latent channels inside the shape.
COLORS: dict[str, tuple[float, float, float, float]] = {
    "red": (1.6, -0.6, 0.4, -1.0),
    "green": (-1.2, 1.4, -0.3, 0.5),
    "blue": (-0.4, -1.0, 1.6, 0.8),
    "yellow": (1.2, 1.2, -1.0, -0.2),
    "purple": (0.6, -1.4, 1.0, -1.2),
    "orange": (1.4, 0.3, -0.8, -1.4),
    "white": (0.9, 0.9, 0.9, 1.2),
    "black": (-1.5, -1.3, -1.2, -0.9),
}
#: Background word -> mean of the 4 latent channels outside the shape.
BACKGROUNDS: dict[str, tuple[float, float, float, float]] = {
    "gray": (0.0, 0.0, 0.0, 0.0),
    "light": (0.7, 0.6, 0.7, 0.8),
    "dark": (-0.8, -0.7, -0.8, -0.6),
    "sky blue": (-0.3, -0.2, 0.9, 0.4),
    "sandy": (0.6, 0.4, -0.5, 0.1),
}
#: Shape words (each a mask function below).
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "ring", "cross", "diamond", "stripes")
#: Style word -> (texture amplitude, texture kind).
STYLES: dict[str, tuple[float, str]] = {
    "flat illustration": (0.05, "white"),
    "photograph": (0.35, "white"),
    "watercolor painting": (0.45, "smooth"),
    "pixel art": (0.35, "blocky"),
}

_LLAVA_TEMPLATES = (
    "The image shows a {color} {shape} {where} on a {background} background. "
    "It is rendered as a {style}, with clean edges and even lighting.",
    "This is a {style} of a single {color} {shape}. The {shape} sits {where} against "
    "a plain {background} background, and nothing else is in the frame.",
    "A {style} depicting a {color} {shape} {where}. The background is a uniform "
    "{background} tone that contrasts with the {color} shape.",
)
_ALT_TEMPLATES = (
    "{color} {shape} {style}",
    "{style} - {color} {shape} on {background}",
    "stock image: {color} {shape}, {background} background",
)
_WHITESPACE = (" ", "   ", "\t", "\n", " \t\n ", "\u3000")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoData:
    """A generated demo dataset and the defects planted in it.

    Attributes:
        out_dir: the dataset folder.
        shard_paths: the latent shards, in natural order.
        metadata_path: the caption parquet.
        num_latent_rows: latent rows over all shards (counting the duplicate).
        num_meta_rows: rows of the metadata parquet (counting the duplicate row).
        latent_keys_without_meta: unique latent keys with no metadata row.
        meta_rows_without_latents: metadata keys with no latents (``no_latents``).
        null_captions: latent keys whose caption is null (all caption columns).
        empty_captions: latent keys whose caption is "" (all caption columns).
        whitespace_captions: latent keys whose caption is whitespace only.
        duplicate_latent_keys: keys present in two shards (extra occurrences).
        duplicate_meta_rows: extra metadata rows repeating an earlier key.
        clean_samples: unique latent keys with a usable caption (the expected output).
        key_as_index: whether the key was written as the pandas index.
        params: the generation parameters.
    """

    out_dir: Path
    shard_paths: tuple[Path, ...]
    metadata_path: Path
    num_latent_rows: int
    num_meta_rows: int
    latent_keys_without_meta: int
    meta_rows_without_latents: int
    null_captions: int
    empty_captions: int
    whitespace_captions: int
    duplicate_latent_keys: int
    duplicate_meta_rows: int
    clean_samples: int
    key_as_index: bool
    params: dict

    @property
    def num_unique_latent_keys(self) -> int:
        """Distinct latent keys."""
        return self.num_latent_rows - self.duplicate_latent_keys


def generate_demo(
    out_dir: str | os.PathLike,
    *,
    num_shards: int = 6,
    samples_per_shard: int = 500,
    seed: int = 0,
    latent_dtype: str = "float16",
    key_as_index: bool = False,
    num_proc: int = 1,
) -> DemoData:
    """Generate (or reuse) the demo dataset in ``out_dir``.

    Process-safe: concurrent calls on the same ``out_dir`` (also from other hosts over
    NFS) each build into a private temp folder beside it and ``os.rename`` it into
    place; the first rename wins and the others delete their copy. A complete folder
    carries ``manifest.json`` (parameters, files, sizes); a later call with the same
    parameters returns at once.

    Args:
        out_dir: target folder (created; must not hold anything else).
        num_shards: number of ``.pt`` shards (>= 1).
        samples_per_shard: latent rows per shard (>= 10).
        seed: RNG seed; same parameters give byte-identical files.
        latent_dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"`` in the shards.
        key_as_index: write the key as the (unnamed) pandas index, stored as
            ``__index_level_0__``, like some real metadata files.
        num_proc: processes writing the shards (>= 1; 1: all in this process). The
            files are the same bytes whatever its value, so it is not a parameter of
            the dataset (a folder made with one value is reused with another). The
            workers are spawned (a fresh interpreter each, never a fork of a caller
            that may run CUDA or JAX threads), so a script calling this with
            ``num_proc > 1`` needs an ``if __name__ == "__main__":`` guard.

    Returns:
        The :class:`DemoData` describing the files and planted defects.

    Raises:
        ValueError: invalid parameters; ``num_proc > 1`` in a program read from standard
            input (its spawned workers could not import it).
        RuntimeError: a worker died (killed, or the calling script has no guard).
        SourceError: ``out_dir`` exists with other content or other parameters.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if samples_per_shard < 10:
        raise ValueError(f"samples_per_shard must be >= 10, got {samples_per_shard}")
    if num_proc < 1:
        raise ValueError(f"num_proc must be >= 1, got {num_proc}")
    if latent_dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(
            f"latent_dtype must be 'float16', 'bfloat16' or 'float32', got {latent_dtype!r}"
        )
    params = {
        "format_version": _FORMAT_VERSION,
        "num_shards": int(num_shards),
        "samples_per_shard": int(samples_per_shard),
        "seed": int(seed),
        "latent_dtype": latent_dtype,
        "key_as_index": bool(key_as_index),
    }
    out = Path(out_dir).expanduser().absolute()
    existing = _read_existing(out, params)
    if existing is not None:
        return existing

    if num_proc > 1 and num_shards > 1:
        _check_spawnable(num_proc)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None  # None once renamed into place
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_dataset(tmp, params, num_proc=num_proc)
        try:
            # rename(2) of a folder onto an absent or *empty* folder is atomic; onto a
            # non-empty one it fails, which is how a concurrent winner is detected.
            os.rename(tmp, out)
        except OSError as exc:
            # ENOTEMPTY / EEXIST: the winner's folder is there, even where this host
            # does not see it yet (a shared filesystem's lookup cache): waited for below.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) and not out.is_dir():
                raise
        else:
            fsync_dir(out.parent)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    existing = _read_existing(out, params)
    deadline = time.monotonic() + _VISIBLE_WAIT_S
    while existing is None and time.monotonic() < deadline:
        time.sleep(0.2)
        existing = _read_existing(out, params)
    if existing is None:
        raise SourceError(
            str(out),
            f"another process published this demo folder, but it was not visible here "
            f"within {_VISIBLE_WAIT_S:.0f} s (or it was deleted meanwhile)",
        )
    return existing


# --------------------------------------------------------------------------- reading back


def _read_existing(out: Path, params: dict) -> DemoData | None:
    """The finished demo in ``out`` if it matches ``params``; None if absent or empty."""
    manifest_path = out / _MANIFEST_NAME
    if not out.exists():
        return None
    if not out.is_dir():
        raise SourceError(str(out), "demo output path exists and is not a folder")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if not any(out.iterdir()):
            return None  # an empty folder (e.g. made by the user): ours to fill
        raise SourceError(
            str(out), f"folder is not empty and has no {_MANIFEST_NAME}; not a demo folder"
        ) from None
    except (OSError, ValueError) as exc:
        raise SourceError(str(out), f"unreadable {_MANIFEST_NAME}: {exc}") from None
    if manifest.get("params") != params:
        raise SourceError(
            str(out),
            f"holds a demo generated with {manifest.get('params')}, not {params}; "
            "use another folder or delete this one",
        )
    try:
        for name, info in manifest["files"].items():
            p = out / name
            try:
                size = p.stat().st_size
            except OSError:
                size = -1
            if size != info["size"]:
                raise SourceError(
                    str(p),
                    f"demo file has {size} bytes, manifest says {info['size']}; delete {out}",
                )
        return DemoData(
            out_dir=out,
            shard_paths=tuple(out / n for n in manifest["shards"]),
            metadata_path=out / METADATA_NAME,
            key_as_index=params["key_as_index"],
            params=dict(params),
            **manifest["counts"],
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise SourceError(
            str(manifest_path),
            f"malformed demo manifest ({type(exc).__name__}: {exc}); delete {out}",
        ) from None


#: How long a process that lost the race to publish the demo waits to see the winner's
#: folder (NFS keeps a negative lookup for up to ``acdirmax``, 60 s by default).
_VISIBLE_WAIT_S = 90.0

# --------------------------------------------------------------------------- generation


def _check_spawnable(num_proc: int) -> None:
    """Refuse a pool whose spawned processes could not import the main program (they
    import it first: one read from standard input, ``python - <<EOF``, is no file), and
    a call made by a spawned process while it imports an unguarded main script (before
    it writes anything: the caller then reports its dead worker)."""
    from hf_pipeline.workers.pool import check_not_bootstrapping, unimportable_main

    check_not_bootstrapping("generate_demo", "its shard writers are spawned")
    path = unimportable_main()
    if path is not None:
        raise ValueError(
            f"generate_demo(num_proc={num_proc}) writes the shards in spawned processes, which "
            f"import the main program first, and {path!r} is not a file: run it from a script "
            f'(under `if __name__ == "__main__":`), or use num_proc=1'
        )


def _write_dataset(folder: Path, params: dict, *, num_proc: int = 1) -> None:
    """Write shards, metadata and manifest (last) into ``folder``.

    With ``num_proc > 1`` a pool of spawned processes renders and writes the shards while
    this process writes the metadata. The bytes do not depend on it: everything drawn
    from the dataset-wide RNG stream (keys, scene words, defects, captions) is drawn
    here, in the same order, and each shard's latents come from a stream of its own.
    """
    rng = np.random.default_rng([params["seed"], 0x0C0F0])
    n_shards, per = params["num_shards"], params["samples_per_shard"]
    total = n_shards * per

    # Non-contiguous int64 ids, like COYO's: a large base plus random gaps. Metadata-only
    # keys are drawn from the same sequence so they interleave with latent keys.
    n_meta_only = max(1, total // 100)
    all_keys = 4_000_000_000_000 + np.cumsum(rng.integers(1, 997, size=total + n_meta_only))
    pick = rng.permutation(total + n_meta_only)
    latent_keys = np.sort(all_keys[pick[:total]])
    meta_only_keys = np.sort(all_keys[pick[total:]])

    attrs = _draw_attributes(rng, total)

    # Defects on disjoint latent rows (the first row of each shard stays clean, so the
    # duplicate below always copies a clean row).
    n_no_meta = max(1, total // 100)
    n_null = max(1, total // 300)
    n_empty = max(1, total // 200)
    n_space = max(1, total // 200)
    candidates = rng.permutation(np.setdiff1d(np.arange(total), np.arange(0, total, per)))
    cut = np.cumsum([n_no_meta, n_null, n_empty, n_space])
    no_meta_rows, null_rows, empty_rows, space_rows, rest = np.split(candidates, cut)
    dup_meta_row = int(rest[0])  # a clean row whose metadata row is written twice

    # One key in two shards (the real release has a few): the first row of the last
    # shard repeats shard 0's first key and image, re-encoded (a little fresh noise).
    # A single shard cannot have a cross-shard duplicate, so that case plants none.
    shard_keys = latent_keys.copy()
    dup_dst = (n_shards - 1) * per if n_shards > 1 else None
    if dup_dst is not None:
        shard_keys[dup_dst] = latent_keys[0]
        for name in ("color", "shape", "background", "style", "where", "cy", "cx", "radius"):
            attrs[name][dup_dst] = attrs[name][0]

    def rows(lo: int, hi: int) -> dict[str, np.ndarray]:
        return {k: v[lo:hi] for k, v in attrs.items()}

    jobs = [
        _ShardJob(
            path=folder / f"{s * per:06d}-{(s + 1) * per - 1:06d}.pt",
            seed=params["seed"],
            index=s,
            latent_dtype=params["latent_dtype"],
            keys=shard_keys[s * per : (s + 1) * per],
            attrs=rows(s * per, (s + 1) * per),
            first_attrs=rows(0, per) if s * per == dup_dst else None,
        )
        for s in range(n_shards)
    ]
    pool = None
    if num_proc > 1 and n_shards > 1:
        pool = ProcessPoolExecutor(
            max_workers=min(num_proc, n_shards),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_shard_worker,
        )
    try:
        pending: list[Future] = [pool.submit(_write_shard, job) for job in jobs] if pool else []
        # The dataset-wide stream goes on here, after the draws above, as without a pool.
        counts = _write_metadata_file(
            folder / METADATA_NAME,
            rng,
            attrs,
            shard_keys,
            meta_only_keys,
            no_meta_rows=no_meta_rows,
            null_rows=null_rows,
            empty_rows=empty_rows,
            space_rows=space_rows,
            dup_meta_row=dup_meta_row,
            dup_latent_rows=np.array([dup_dst] if dup_dst is not None else [], dtype=np.int64),
            key_as_index=params["key_as_index"],
        )
        shard_files = [f.result() for f in pending] if pool else [_write_shard(j) for j in jobs]
    except BrokenProcessPool:
        main = getattr(sys.modules["__main__"], "__file__", None) or "the main program"
        raise RuntimeError(
            f"generate_demo(num_proc={num_proc}): a process writing the shards died (killed, or "
            f"it failed as it started: see its message above). A spawned process imports "
            f"{main} first: if that script calls generate_demo outside "
            f'`if __name__ == "__main__":`, each process ran it again'
        ) from None
    finally:
        if pool is not None:
            # On an error, the shards not started yet are dropped, not written for nothing.
            pool.shutdown(wait=True, cancel_futures=True)

    files: dict[str, dict] = dict(shard_files)
    files[METADATA_NAME] = _describe(folder / METADATA_NAME)
    counts.update(num_latent_rows=total, duplicate_latent_keys=int(dup_dst is not None))
    shard_names = [job.path.name for job in jobs]
    manifest = {"params": params, "shards": shard_names, "files": files, "counts": counts}
    # Durable: fsyncs the file and then the folder, covering every name created in it.
    with atomic_write(folder / _MANIFEST_NAME) as fh:
        fh.write((json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ShardJob:
    """One shard to render and write (picklable: it goes to a pool worker).

    ``first_attrs``: shard 0's scene rows, for the shard that repeats shard 0's first
    image (that image is rendered again from shard 0's own stream, not passed around).
    """

    path: Path
    seed: int
    index: int
    latent_dtype: str
    keys: np.ndarray
    attrs: dict[str, np.ndarray]
    first_attrs: dict[str, np.ndarray] | None


def _init_shard_worker() -> None:
    import torch

    # One thread a worker: num_proc workers of torch's default (a thread per CPU)
    # would oversubscribe the CPUs for the dtype conversion. Same bytes either way.
    torch.set_num_threads(1)


def _shard_latents(seed: int, index: int, attrs: dict[str, np.ndarray]):
    """Shard ``index``'s RNG stream and its latents (N, 3, 4, 32, 32) float32."""
    # Each shard its own stream: memory stays O(samples_per_shard) however many shards
    # are asked for, and the shards can be written in any order, by any process.
    srng = np.random.default_rng([seed, 0x0C0F0, index + 1])
    return srng, _render_latents(srng, attrs)


def _write_shard(job: _ShardJob) -> tuple[str, dict]:
    """Render and write one shard; its name and manifest entry (size, sha256)."""
    import torch

    srng, lat = _shard_latents(job.seed, job.index, job.attrs)
    if job.first_attrs is not None:
        first_image = _shard_latents(job.seed, 0, job.first_attrs)[1][0]
        lat[0] = first_image + srng.normal(0.0, 0.02, size=first_image.shape).astype(np.float32)
    # Within a shard the order is shuffled: consumers must not rely on sorted keys.
    order = srng.permutation(len(job.keys))
    tdtype = getattr(torch, job.latent_dtype)  # float16, bfloat16 or float32 (checked)
    keys_t = torch.from_numpy(job.keys[order].copy())
    # clone(): torch.save writes a view's whole storage; each shard owns exactly its rows.
    lat_t = torch.from_numpy(np.ascontiguousarray(lat[order])).to(tdtype).clone()
    del lat
    _save_torch(job.path, {"keys": keys_t, "latents": lat_t})
    return job.path.name, _describe(job.path)


def _write_metadata_file(
    path: Path,
    rng: np.random.Generator,
    attrs: dict[str, np.ndarray],
    keys: np.ndarray,
    meta_only_keys: np.ndarray,
    *,
    key_as_index: bool,
    **defects: Any,  # _metadata_rows's keyword arguments (arrays and dup_meta_row)
) -> dict[str, int]:
    """Draw the captions and metadata rows from ``rng``, write the parquet; the counts."""
    captions = _captions(rng, attrs, keys)
    meta_cols, counts = _metadata_rows(rng, keys, captions, meta_only_keys, **defects)
    _write_metadata(path, meta_cols, key_as_index=key_as_index)
    return counts


def _describe(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _draw_attributes(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Per-sample scene words (as indices) plus the shape's centre and size."""
    attrs = {
        "color": rng.integers(0, len(COLORS), n),
        "shape": rng.integers(0, len(SHAPES), n),
        "background": rng.integers(0, len(BACKGROUNDS), n),
        "style": rng.integers(0, len(STYLES), n),
        "cy": rng.uniform(11, 21, n),
        "cx": rng.uniform(11, 21, n),
        "radius": rng.uniform(6.5, 10.5, n),
    }
    # Position word from the uncropped centre: 0 centre, 1 left, 2 right, 3 top, 4 bottom.
    dy, dx = attrs["cy"] - 15.5, attrs["cx"] - 15.5
    where = np.zeros(n, dtype=np.int64)
    off = np.maximum(np.abs(dx), np.abs(dy)) > 2.5
    horiz = np.abs(dx) >= np.abs(dy)
    where[off & horiz & (dx < 0)] = 1
    where[off & horiz & (dx >= 0)] = 2
    where[off & ~horiz & (dy < 0)] = 3
    where[off & ~horiz & (dy >= 0)] = 4
    attrs["where"] = where
    return attrs


def _render_latents(rng: np.random.Generator, attrs: dict[str, np.ndarray]) -> np.ndarray:
    """Latents (N, 3, 4, 32, 32) float32, std about 1 like scaled VAE latents."""
    n = attrs["color"].shape[0]
    # 3 crops = the same scene shifted by up to 2 latent pixels (the release's
    # centre-ish crops), each with its own small noise.
    shift = rng.integers(-2, 3, size=(n, 3, 2)).astype(np.float64)
    shift[:, 0] = 0.0
    cy = attrs["cy"][:, None] + shift[..., 0]
    cx = attrs["cx"][:, None] + shift[..., 1]
    yy, xx = np.meshgrid(
        np.arange(_SIZE, dtype=np.float32), np.arange(_SIZE, dtype=np.float32), indexing="ij"
    )
    v = yy[None, None] - cy[..., None, None].astype(np.float32)  # (n, 3, 32, 32)
    u = xx[None, None] - cx[..., None, None].astype(np.float32)
    r = attrs["radius"][:, None, None, None].astype(np.float32)
    masks = np.zeros((n, 3, _SIZE, _SIZE), dtype=bool)
    for s_idx, shape in enumerate(SHAPES):
        sel = attrs["shape"] == s_idx
        if sel.any():
            masks[sel] = _shape_mask(shape, u[sel], v[sel], r[sel])

    color = np.asarray(list(COLORS.values()), dtype=np.float32)[attrs["color"]]  # (n, 4)
    bg = np.asarray(list(BACKGROUNDS.values()), dtype=np.float32)[attrs["background"]]
    m = masks[:, :, None].astype(np.float32)  # (n, 3, 1, 32, 32)
    lat = bg[:, None, :, None, None] + m * (color - bg)[:, None, :, None, None]

    for st_idx, (amp, kind) in enumerate(STYLES.values()):
        sel = np.flatnonzero(attrs["style"] == st_idx)
        if sel.size:
            lat[sel] += amp * _texture(rng, kind, sel.size)[:, None]  # shared by the crops
    lat += 0.08 * rng.standard_normal(size=lat.shape, dtype=np.float32)
    lat *= _SCALE
    return lat


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Boolean mask of ``shape`` for offsets ``u`` (x) and ``v`` (y) and radius ``r``."""
    if shape == "circle":
        return u * u + v * v <= r * r
    if shape == "square":
        return (np.abs(u) <= 0.8 * r) & (np.abs(v) <= 0.8 * r)
    if shape == "triangle":
        # Apex up at v = -r, base at v = 0.8 r.
        return (v >= -r) & (v <= 0.8 * r) & (np.abs(u) <= (v + r) * 0.6)
    if shape == "ring":
        d2 = u * u + v * v
        return (d2 <= r * r) & (d2 >= (0.55 * r) ** 2)
    if shape == "cross":
        return ((np.abs(u) <= 0.3 * r) & (np.abs(v) <= r)) | (
            (np.abs(v) <= 0.3 * r) & (np.abs(u) <= r)
        )
    if shape == "diamond":
        return np.abs(u) + np.abs(v) <= r
    if shape == "stripes":
        band = (np.floor((v + r) / 3.0) % 2) == 0
        return band & (np.abs(u) <= r) & (np.abs(v) <= r)
    raise AssertionError(f"unknown shape {shape}")


def _texture(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    """(n, 4, 32, 32) unit-ish texture: white noise, smooth blobs or 4x4 blocks."""
    if kind == "white":
        return rng.standard_normal(size=(n, 4, _SIZE, _SIZE), dtype=np.float32)
    if kind == "blocky":
        small = rng.normal(0.0, 1.0, size=(n, 4, _SIZE // 4, _SIZE // 4)).astype(np.float32)
        return small.repeat(4, axis=2).repeat(4, axis=3)
    if kind == "smooth":
        small = rng.normal(0.0, 1.0, size=(n, 4, _SIZE // 8, _SIZE // 8)).astype(np.float32)
        big: np.ndarray = small.repeat(8, axis=2).repeat(8, axis=3)
        # Box-blur the 8x8 blocks along both axes (circular, cheap) to get soft blobs.
        for axis in (2, 3):
            # sum() of arrays is an array (typeshed types it as possibly the int start 0)
            big = cast(np.ndarray, sum(np.roll(big, k, axis=axis) for k in range(-4, 4))) / 8.0
        return (big * 1.6).astype(np.float32)
    raise AssertionError(f"unknown texture {kind}")


def _captions(
    rng: np.random.Generator, attrs: dict[str, np.ndarray], keys: np.ndarray
) -> dict[str, list[str]]:
    """The three caption columns plus url for every latent row."""
    colors, bgs, styles = list(COLORS), list(BACKGROUNDS), list(STYLES)
    wheres = ("in the centre", "on the left", "on the right", "near the top", "near the bottom")
    t_llava = rng.integers(0, len(_LLAVA_TEMPLATES), len(keys))
    t_alt = rng.integers(0, len(_ALT_TEMPLATES), len(keys))
    out: dict[str, list[str]] = {"caption_llava": [], "caption": [], "caption_llava_short": []}
    for i in range(len(keys)):
        words = {
            "color": colors[attrs["color"][i]],
            "shape": SHAPES[attrs["shape"][i]],
            "background": bgs[attrs["background"][i]],
            "style": styles[attrs["style"][i]],
            "where": wheres[attrs["where"][i]],
        }
        out["caption_llava"].append(_LLAVA_TEMPLATES[t_llava[i]].format(**words))
        out["caption"].append(_ALT_TEMPLATES[t_alt[i]].format(**words))
        out["caption_llava_short"].append(
            "a {color} {shape} on a {background} background, {style}".format(**words)
        )
    return out


def _metadata_rows(
    rng: np.random.Generator,
    keys: np.ndarray,
    captions: dict[str, list[str]],
    meta_only_keys: np.ndarray,
    *,
    no_meta_rows: np.ndarray,
    null_rows: np.ndarray,
    empty_rows: np.ndarray,
    space_rows: np.ndarray,
    dup_meta_row: int,
    dup_latent_rows: np.ndarray,
) -> tuple[dict[str, list], dict[str, int]]:
    """Metadata columns (with the planted defects, rows shuffled) and their counts."""
    cap_cols = ("caption_llava", "caption", "caption_llava_short")
    cols: dict[str, list] = {c: list(captions[c]) for c in cap_cols}
    for i in null_rows:
        for c in cap_cols:
            cols[c][i] = None
    for i in empty_rows:
        for c in cap_cols:
            cols[c][i] = ""
    for j, i in enumerate(space_rows):
        for c in cap_cols:
            cols[c][i] = _WHITESPACE[j % len(_WHITESPACE)]

    # A duplicated latent key (later row) has the same caption as its first occurrence
    # and one metadata row: drop the later row from the metadata.
    keep = np.ones(len(keys), dtype=bool)
    keep[no_meta_rows] = False
    keep[dup_latent_rows] = False
    rows = list(np.flatnonzero(keep)) + [int(dup_meta_row)]
    meta_keys = [int(keys[i]) for i in rows]
    meta: dict[str, list[Any]] = {"key": meta_keys}
    for c in cap_cols:
        meta[c] = [cols[c][i] for i in rows]

    # Metadata-only rows: ordinary captions about scenes whose latents are missing.
    words_c, words_s = list(COLORS), SHAPES
    for k in meta_only_keys:
        c, s = words_c[rng.integers(len(words_c))], words_s[rng.integers(len(words_s))]
        meta["key"].append(int(k))
        meta["caption_llava"].append(f"The image shows a {c} {s} on a gray background.")
        meta["caption"].append(f"{c} {s}")
        meta["caption_llava_short"].append(f"a {c} {s} on a gray background, photograph")
    meta["url"] = [f"https://images.example.com/coyo/{k}.jpg" for k in meta["key"]]

    # Shuffle so readers cannot depend on metadata order. The duplicated row is an
    # exact copy, so "keep the first" gives the same caption wherever it lands.
    perm = rng.permutation(len(meta["key"]))
    meta = {c: [vals[i] for i in perm] for c, vals in meta.items()}

    n_unique = len(np.unique(keys))
    bad = len(no_meta_rows) + len(null_rows) + len(empty_rows) + len(space_rows)
    counts = {
        "num_meta_rows": len(meta["key"]),
        "latent_keys_without_meta": int(len(no_meta_rows)),
        "meta_rows_without_latents": int(len(meta_only_keys)),
        "null_captions": int(len(null_rows)),
        "empty_captions": int(len(empty_rows)),
        "whitespace_captions": int(len(space_rows)),
        "duplicate_meta_rows": 1,
        "clean_samples": int(n_unique - bad),
    }
    return meta, counts


def _write_metadata(path: Path, meta: dict[str, list], *, key_as_index: bool) -> None:
    """Write the parquet deterministically (no timestamps; fixed writer options)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    caption_cols = ("caption_llava", "caption", "caption_llava_short", "url")
    arrays = {c: pa.array(meta[c], type=pa.string()) for c in caption_cols}
    key = pa.array(meta["key"], type=pa.int64())
    if key_as_index:
        import pandas as pd

        df = pd.DataFrame({c: meta[c] for c in caption_cols})
        # An unnamed index: pandas stores it as "__index_level_0__" and records it in
        # the schema's pandas metadata, the awkward case readers must handle.
        df.index = pd.Index(np.asarray(meta["key"], dtype=np.int64))
        table = pa.Table.from_pandas(df, preserve_index=True)
    else:
        table = pa.table({"key": key, **arrays})
    with atomic_write(path) as fh:
        pq.write_table(table, fh, compression="zstd", row_group_size=max(1, len(key)))


def _save_torch(path: Path, obj: dict) -> None:
    import torch

    with atomic_write(path) as fh:
        torch.save(obj, fh)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
