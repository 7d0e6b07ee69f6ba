"""Write a ``CausalLM`` checkpoint of any layout back as a Hugging Face ``save_pretrained`` folder.

Usage::

    python -m lightning_hybrid.utilities.export_pretrained CHECKPOINT OUT_DIR [--max-shard-size 2GB]

``CHECKPOINT`` is a sharded checkpoint folder of either engine (any pipeline, ZeRO stage or world size) or a
single-file Lightning checkpoint. ``OUT_DIR`` gets ``config.json`` and ``model.safetensors`` (or shards of at
most ``--max-shard-size`` with ``model.safetensors.index.json``) under the model's own names, so that
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it with nothing missing or unexpected. A tied
embedding is written once, under the name ``transformers`` stores it by.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Union

import torch

from lightning_hybrid.checkpoint._safe_load import load_payload
from lightning_hybrid.utilities.consolidate import consolidated_lightning_checkpoint

__all__ = ["export_pretrained", "main"]


def export_pretrained(
    checkpoint: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *, max_shard_size: Union[int, str] = "5GB"
) -> Path:
    """Export ``checkpoint`` (of a :class:`~lightning_hybrid.models.CausalLM`) to ``out_dir``; returns it."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    from lightning_hybrid.models import CausalLM

    path, out = Path(checkpoint), Path(out_dir)
    checkpoint = _read(path)
    state = checkpoint["state_dict"]
    hparams = checkpoint.get("hyper_parameters") or {}
    source = hparams.get("model")
    if source is None:
        raise ValueError(
            f"{path} was not written by a lightning_hybrid.models.CausalLM (its hyper_parameters name no model);"
            " export_pretrained writes CausalLM checkpoints only."
        )
    with torch.device("meta"):
        model = CausalLM(source if isinstance(source, dict) else Path(source))
    stale = sorted(
        p.name for p in out.glob("*") if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")
    )
    if stale:
        raise ValueError(
            f"{out} already holds model files ({', '.join(stale[:3])}); from_pretrained would mix them with the"
            " export. Export into an empty or new folder."
        )
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    names = model.hf_state_dict_names()
    missing = sorted(set(names) - set(state))
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}, ...).")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for ours, theirs in names.items():
        tensor = state[ours]
        if id(tensor) in seen or theirs in tensors or (tied and theirs == "lm_head.weight"):
            continue  # a tied weight: stored once, under the input embedding's name
        seen.add(id(tensor))
        tensors[theirs] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(model.config)
    config.use_cache = True  # CausalLM trains without a cache; generation wants one
    config.save_pretrained(out)
    generation = Path(source) / "generation_config.json" if isinstance(source, str) else None
    if generation is not None and generation.is_file():  # the folder's eos ids and sampling defaults
        shutil.copyfile(generation, out / "generation_config.json")
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)  # transformers' own sizes
    for name, keys in split.filename_to_tensors.items():
        save_file({key: tensors[key] for key in keys}, str(out / name), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _read(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint dict with the whole model's ``state_dict``, from a sharded folder or one file."""
    return consolidated_lightning_checkpoint(path) if path.is_dir() else load_payload(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_hybrid.utilities.export_pretrained",
        description="Write a CausalLM checkpoint of any layout as a Hugging Face save_pretrained folder.",
    )
    parser.add_argument("checkpoint", type=Path, help="a sharded checkpoint folder or a single-file checkpoint")
    parser.add_argument("out_dir", type=Path, help="the save_pretrained folder to write")
    parser.add_argument("--max-shard-size", default="5GB", help="the largest safetensors file (default 5GB)")
    args = parser.parse_args(argv)
    out = export_pretrained(args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")


if __name__ == "__main__":
    main()
