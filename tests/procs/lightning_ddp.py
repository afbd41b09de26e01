"""One Lightning DDP job (2 CPU ranks, gloo) over the LatentDataModule.

Run as a script: Lightning's ``strategy="ddp"`` starts the other rank by running this
file again with its own variables (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``).
Arguments: an output folder, ``pre`` or ``fit`` (whether ``dm.setup("fit")`` runs before
``Trainer.fit``, as README's example does to size the model), the embedding size, then
config overrides. Each rank writes ``rank<global rank>.json``: the keys of every batch
its training step got.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    out, when, dim, *overrides = sys.argv[1:]
    import lightning as L
    import torch

    from hf_pipeline.adapters.torch_data import LatentDataModule
    from hf_pipeline.config import load_config

    class Recorder(L.LightningModule):
        def __init__(self, embed_dim: int):
            super().__init__()
            self.lin = torch.nn.Linear(embed_dim, 1)
            self.seen: list[list[int]] = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["keys"].tolist())
            target = batch["latents"].float().mean(dim=(1, 2, 3))
            return torch.nn.functional.mse_loss(self.lin(batch["embeddings"]).squeeze(-1), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_end(self):
            path = Path(out) / f"rank{self.global_rank}.json"
            path.write_text(json.dumps({"world": self.trainer.world_size, "seen": self.seen}))

    dm = LatentDataModule(load_config(None, overrides, environ={}), num_workers=0)
    if when == "pre":
        dm.setup("fit")  # README: size the model from the cache before fitting
        assert dm.source.embed_dim == int(dim)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Recorder(int(dim)), datamodule=dm)


if __name__ == "__main__":
    main()
