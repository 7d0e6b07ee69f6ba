"""Turn a sharded (DCP) checkpoint folder into a plain ``state_dict`` for the unsplit LightningModule.

Usage::

    python -m lightning_hybrid.utilities.consolidate CHECKPOINT_DIR OUTPUT.ckpt

writes a single-file Lightning checkpoint that ``YourModule.load_from_checkpoint(OUTPUT.ckpt)`` loads.
Reading a checkpoint never runs code from it: the DCP index is read through an allow-list and every
payload with ``weights_only=True``. A folder written by ``FaultTolerantCheckpoint`` is verified against
its manifest (sizes and SHA-256) first.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hybrid.checkpoint._files import atomic_write
from lightning_hybrid.checkpoint._sharded import (
    LAYOUT_KEY,
    read_meta,
    read_sharded,
    read_sharded_index,
    verified_checkpoint,
)

__all__ = ["consolidate_checkpoint", "consolidated_lightning_checkpoint", "main"]


def consolidate_checkpoint(path: str | Path, *, prefix: str = "state_dict") -> dict[str, torch.Tensor]:
    """Read every shard of a checkpoint's model weights into one plain ``state_dict`` (CPU tensors).

    Works in a single process without a process group, whatever layout (pipeline stages, ZeRO stage,
    world size) wrote the checkpoint. Parameter names are those of the unsplit module; a parameter tied
    across blocks (stored once) appears under each of its names as one tensor, as ``module.state_dict()``
    has it, so ``load_state_dict`` accepts it strictly and ``torch.save`` still writes it once. Raises
    ``ValueError`` when a manifest exists and the files do not match it.
    """
    path = verified_checkpoint(path)
    metadata = read_sharded_index(path).state_dict_metadata
    template = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix + ".") and isinstance(meta, TensorStorageMetadata)
    }
    if not template:
        raise ValueError(f"{path} holds no tensors under {prefix!r}.")
    read_sharded(path, template, no_dist=True)  # this process alone, whatever process group exists
    state = {key[len(prefix) + 1 :]: value for key, value in template.items()}
    if prefix == "state_dict":
        layout = read_meta(path).get(LAYOUT_KEY) or {}
        for names in layout.get("tied_parameters", []):
            if names[0] in state:
                state.update({alias: state[names[0]] for alias in names[1:]})
    return state


def consolidated_lightning_checkpoint(path: Path) -> dict[str, Any]:
    """The Lightning checkpoint a sharded folder holds, its ``state_dict`` consolidated (layout record dropped)."""
    checkpoint = read_meta(path)
    checkpoint["state_dict"] = consolidate_checkpoint(path)
    checkpoint.pop(LAYOUT_KEY, None)
    return checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hybrid.utilities.consolidate",
        description="Convert a sharded lightning-hybrid checkpoint into a single-file Lightning checkpoint.",
    )
    parser.add_argument("checkpoint", type=Path, help="the checkpoint folder (it holds .metadata)")
    parser.add_argument("output", type=Path, help="where to write the single-file checkpoint")
    args = parser.parse_args(argv)
    checkpoint = consolidated_lightning_checkpoint(args.checkpoint)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.output, lambda f: torch.save(checkpoint, f))  # never a partial file under the name
    n = sum(t.numel() for t in {id(t): t for t in checkpoint["state_dict"].values()}.values())  # tied: once
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors, {n:,} parameters")


if __name__ == "__main__":
    main()
