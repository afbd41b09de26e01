"""Pickles that must never be loaded: what ``torch.load(weights_only=True)`` refuses."""

from __future__ import annotations

import os


class RunsCode:
    """Pickles to a call of ``os.system`` that touches ``marker``: loading it unsafely
    would run code (the marker file then exists)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
