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
from lightning_hybrid.checkpoint._sharded import read_meta
from lightning_hybrid.utilities.consolidate import consolidate_checkpoint

__all__ = ["export_pretrained", "main"]

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}


def export_pretrained(
    checkpoint: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *, max_shard_size: Union[int, str] = "5GB"
) -> Path:
    """Export ``checkpoint`` (of a :class:`~lightning_hybrid.models.CausalLM`) to ``out_dir``; returns it."""
    from safetensors.torch import save_file

    from lightning_hybrid.models import CausalLM

    path, out = Path(checkpoint), Path(out_dir)
    meta, state = _read(path)
    hparams = meta.get("hyper_parameters") or {}
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
        if ours not in model.state_dict(keep_vars=True):
            continue
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
    shards = _shards(tensors, _bytes(max_shard_size))
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if path.is_dir():
        return read_meta(path), consolidate_checkpoint(path)
    checkpoint = load_payload(path)
    return checkpoint, checkpoint["state_dict"]


def _bytes(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    for unit in sorted(_UNITS, key=len, reverse=True):
        if size.endswith(unit):
            return int(float(size[: -len(unit)]) * _UNITS[unit])
    return int(size)


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


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
