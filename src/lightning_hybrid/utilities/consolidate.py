"""Turn a sharded (DCP) checkpoint directory into a plain ``state_dict`` for the unsplit LightningModule.

Usage::

    python -m lightning_hybrid.utilities.consolidate CHECKPOINT_DIR OUTPUT.ckpt

writes a single-file Lightning checkpoint that ``YourModule.load_from_checkpoint(OUTPUT.ckpt)`` loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hybrid._lightning_compat import _METADATA_FILENAME

__all__ = ["consolidate_checkpoint", "main"]


def consolidate_checkpoint(path: str | Path, *, prefix: str = "state_dict") -> dict[str, torch.Tensor]:
    """Read every shard of a checkpoint's model weights into one plain ``state_dict`` (CPU tensors).

    Works in a single process without a process group, whatever layout (pipeline stages, ZeRO stage,
    world size) wrote the checkpoint. Parameter names are those of the unsplit module.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint: it has no .metadata file.")
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    template = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(prefix + ".") and isinstance(meta, TensorStorageMetadata)
    }
    if not template:
        raise ValueError(f"{path} holds no tensors under {prefix!r}.")
    dcp.load(template, checkpoint_id=path, no_dist=True)
    return {key[len(prefix) + 1 :]: value for key, value in template.items()}


def _consolidated_lightning_checkpoint(path: Path) -> dict[str, Any]:
    checkpoint = torch.load(path / _METADATA_FILENAME, weights_only=False)
    checkpoint["state_dict"] = consolidate_checkpoint(path)
    checkpoint.pop("hybrid_layout", None)
    return checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hybrid.utilities.consolidate",
        description="Convert a sharded lightning-hybrid checkpoint into a single-file Lightning checkpoint.",
    )
    parser.add_argument("checkpoint", type=Path, help="the checkpoint directory (it holds .metadata)")
    parser.add_argument("output", type=Path, help="where to write the single-file checkpoint")
    args = parser.parse_args(argv)
    checkpoint = _consolidated_lightning_checkpoint(args.checkpoint)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, args.output)
    n = sum(t.numel() for t in checkpoint["state_dict"].values())
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors, {n:,} parameters")


if __name__ == "__main__":
    main()
