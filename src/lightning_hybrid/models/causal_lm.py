"""``CausalLM``: any Hugging Face ``transformers`` causal LM as a LightningModule every layout can train.

The model's own modules are regrouped into ``self.layers = [embedding, decoder layer x N, head]`` (see
``_hf_cut``), so the pipeline contract holds without a rewrite; the loss is ``transformers``' causal-LM loss
(labels shifted left, ``-100`` ignored) as a mean over the counted tokens of the whole global batch
(``pipeline_loss_count``), which the strategies of this pack keep exact under any split into micro-batches,
replicas and accumulation windows.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_hybrid.checkpoint.pretrained import PretrainedWeights, agreed_plan, load_pretrained, open_weights
from lightning_hybrid.models._hf_cut import cut_causal_lm
from lightning_hybrid.models._hf_tp import hf_tensor_parallel_plan

__all__ = ["CausalLM"]

IGNORE_INDEX = -100  # transformers' ignore index for labels


class CausalLM(pl.LightningModule):
    """A ``transformers`` causal LM (Llama, Qwen2, Mistral, Mixtral, Qwen2-MoE, Phi-3, GPT-2, ...) under the
    pipeline contract, trained by ``HybridParallelStrategy``, ``DeepSpeedPipelineStrategy`` or any Lightning
    strategy.

    Args:
        model: a ``save_pretrained`` folder (its config; its weights are read by the strategy, each rank its own
            stages' tensors, or here under a strategy that does not read them), a ``PretrainedConfig`` (a new
            model, initialised as ``AutoModelForCausalLM.from_config`` under the same seed), a dict of config
            fields with ``model_type``, or a model instance.
        attn_implementation: ``"eager"``, ``"sdpa"`` or ``"flex_attention"``; by default the config's.
        lr: AdamW's learning rate, used when neither LightningCLI's ``optimizer:`` nor a subclass gives another.
        weight_decay: AdamW's weight decay, likewise.

    Batches are dicts as ``transformers`` takes them: ``input_ids``, optional ``attention_mask`` (right or left
    padding) and optional ``labels`` (``-100`` ignored; without them, ``input_ids`` where the mask is 1). A
    tuple ``(input_ids, targets)`` is read as ids and their next tokens (already shifted).

    Example::

        model = CausalLM("path/to/llama")  # save_pretrained output
        trainer = Trainer(strategy=HybridParallelStrategy(pipeline_parallel_size=2, zero_stage=1))
        trainer.fit(model, train_dataloaders=loader)  # batches: {"input_ids", "attention_mask", "labels"}
    """

    def __init__(
        self,
        model: Union[dict[str, Any], str, os.PathLike, Any],  # a dict first: LightningCLI's YAML gives one
        *,
        attn_implementation: Union[str, None] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

        self.lr, self.weight_decay = lr, weight_decay
        self.folder: Union[Path, None] = None
        self._converted = False  # the folder was read by transformers' own loader (see below)
        self._passed_over_told: set[str] = set()  # the tensor-parallel plan's keys said to be passed over
        if isinstance(model, (str, os.PathLike)):
            self.folder = Path(model)
            if not (self.folder / "config.json").is_file():
                raise ValueError(f"CausalLM: {self.folder} is not a save_pretrained folder (no config.json in it).")
            model = AutoConfig.from_pretrained(self.folder)
        elif isinstance(model, Mapping):
            fields = dict(model)
            model_type = fields.pop("model_type", None)
            if model_type is None:
                raise ValueError("CausalLM: a config given as a dict needs its model_type (e.g. 'llama').")
            model = AutoConfig.for_model(model_type, **fields)
        if isinstance(model, PretrainedConfig):
            config = model
            config.use_cache = False
            # a folder's weights are read later, by slice; tied embeddings cannot be built on the meta device
            meta = self.folder is not None and not getattr(config, "tie_word_embeddings", False)
            with torch.device("meta") if meta else contextlib.nullcontext():  # fp32 whatever the folder stores
                hf = AutoModelForCausalLM.from_config(
                    config, dtype=torch.get_default_dtype(), **_attn(attn_implementation)
                )
        elif isinstance(model, nn.Module) and hasattr(model, "config"):
            hf = model
            if attn_implementation is not None:
                hf.set_attn_implementation(attn_implementation)
            hf.config.use_cache = False
        else:
            raise ValueError(
                "CausalLM(model=...) takes a save_pretrained folder, a PretrainedConfig, a dict of config fields or a"
                f" transformers model; got {type(model).__name__}."
            )
        cut = cut_causal_lm(hf)
        if self.folder is not None and not _stored_as_named(self.folder, cut):
            # transformers converts these tensors on load (a MoE's experts, stored one by one, held fused): its
            # own loader reads the folder, on the host of every rank
            rank_zero_info(
                f"CausalLM: {self.folder} stores its tensors under other names than the model holds them"
                " (transformers converts them on load); reading it with from_pretrained on every rank's host"
            )
            hf = AutoModelForCausalLM.from_pretrained(
                self.folder, dtype=torch.get_default_dtype(), **_attn(attn_implementation)
            )
            hf.config.use_cache = False
            cut, self._converted = cut_causal_lm(hf), True
        self.config = hf.config
        self.layers = nn.Sequential(*cut.blocks)
        self._prefixes = cut.prefixes
        self._init_weights = cut.init_weights
        # a folder's weights: read by the strategy or configure_model (or here, converted)
        self._weights_loaded = self.folder is None or self._converted
        self.save_hyperparameters(
            {
                "model": str(self.folder) if self.folder else self.config.to_dict(),
                "attn_implementation": attn_implementation,
                "lr": lr,
                "weight_decay": weight_decay,
            }
        )

    # ------------------------------------------------------------------------------------------ weights

    @property
    def pretrained_weights(self) -> Union[PretrainedWeights, None]:
        """The folder's weights with the key map from Hugging Face's names to ``self.layers``' (read by the
        strategy as its ``init_from`` when it is given none); ``None`` for a model built from a config."""
        if self.folder is None or self._converted:
            return None
        return PretrainedWeights(self.folder, key_map=dict(self._prefixes))

    def hf_state_dict_names(self) -> dict[str, str]:
        """``self.layers``' parameter names -> the Hugging Face model's (a tied weight under its stored name)."""
        out = {}
        for name in self.state_dict():
            for hf_prefix, targets in self._prefixes.items():
                for ours in targets:
                    if name.startswith(ours):
                        out[name] = hf_prefix + name[len(ours) :]
        return out

    def init_block(self, name: str, block: nn.Module) -> None:
        """Initialise a block built on the meta device with the family's own ``_init_weights``."""
        for module in block.modules():
            self._init_weights(module)

    def configure_model(self) -> None:
        """Under a strategy that does not read ``pretrained_weights`` itself, materialise and load them here;
        outside a Trainer (``load_from_checkpoint``), materialise on the host for the checkpoint to fill."""
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer
            trainer = None
        strategy = trainer.strategy if trainer is not None else None
        if getattr(strategy, "reads_pretrained_weights", False):
            self._weights_loaded = True  # the strategy reads each rank's part (init_from)
            if getattr(strategy, "materializes_meta_blocks", False):
                return  # and materialises this rank's blocks only
        device = strategy.root_device if strategy is not None else torch.device("cpu")
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            self.to_empty(device=device)
            for name, block in self.layers.named_children():
                self.init_block(f"layers.{name}", block)  # buffers outside the state_dict (Gemma's embed_scale)
        if self._weights_loaded or trainer is None:
            return
        weights = self.pretrained_weights
        assert weights is not None
        source, plan = agreed_plan(weights, self, device)
        read = load_pretrained(self, plan, source)
        self._weights_loaded = True
        rank_zero_info(f"CausalLM: read {read / 2**20:.1f} MiB of weights from {self.folder}")

    # ------------------------------------------------------------------------------------------ batches

    def pipeline_batch(self, batch: Any) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((input_ids, attention_mask), targets)``: targets are the labels shifted left as transformers shifts
        them (the last position of every row ignored)."""
        if isinstance(batch, Mapping):
            unknown = sorted(set(batch) - {"input_ids", "attention_mask", "labels"})
            if unknown:
                raise ValueError(
                    f"CausalLM takes batches with input_ids, attention_mask and labels; this one also has {unknown},"
                    " which it would ignore (position_ids of packed sequences would let attention cross documents)."
                    " Drop those keys, or pad the sequences instead of packing them."
                )
            ids = batch["input_ids"]
            mask = batch.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask.to(ids.dtype)
            labels = batch.get("labels")
            if labels is None:
                labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
            targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
            return (ids, mask), targets
        ids, targets = batch[0], batch[1]
        return (ids, torch.ones_like(ids)), targets

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean cross-entropy over the counted (not ignored) targets, in fp32 as transformers computes it."""
        total = F.cross_entropy(
            output.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total / self.pipeline_loss_count(target).clamp_min(1)

    def pipeline_loss_count(self, target: Tensor) -> Tensor:
        return (target != IGNORE_INDEX).sum()

    # ------------------------------------------------------------------------------------------ Lightning

    def tensor_parallel_plan(self, name: str, block: nn.Module) -> dict[str, Any]:
        """Each block's split under ``HybridParallelStrategy(tensor_parallel_size=T)``: the model's own
        ``config.base_model_tp_plan`` (see :mod:`lightning_hybrid.models._hf_tp`)."""
        passed_over: set[str] = set()
        plan = hf_tensor_parallel_plan(self.config, block, self.device_mesh["tensor_parallel"].size(), passed_over)
        told = self._passed_over_told
        new = sorted(passed_over - told)  # told once per key: a sparse MoE model passes over its MLP keys everywhere
        if new:
            rank_zero_info(
                f"CausalLM: the {self.config.model_type} tensor-parallel plan names {', '.join(new)}, which {name}"
                " does not have: kept whole on every tensor-parallel rank there, as transformers does"
            )
            told.update(new)
        return plan

    def forward(self, input_ids: Tensor, attention_mask: Union[Tensor, None] = None) -> Tensor:
        """Logits, running the blocks in order (what a pipeline runs stage by stage)."""
        x: Any = (input_ids,) if attention_mask is None else (input_ids, attention_mask)  # the first block fills it
        for block in self.layers:
            x = block(*x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Without a pipeline (under one, the strategy runs the schedule and logs the global ``train_loss``): this
        rank's batch's mean, logged as ``train_loss`` unsynchronised, as under DDP (no collective here)."""
        inputs, target = self.pipeline_batch(batch)
        loss = self.pipeline_loss(self(*inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._evaluate(batch, "val_loss")

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._evaluate(batch, "test_loss")

    def _evaluate(self, batch: Any, name: str) -> Tensor:
        """Without a pipeline (under one, the strategy runs the schedule and logs ``name`` itself)."""
        inputs, target = self.pipeline_batch(batch)
        loss = self.pipeline_loss(self(*inputs), target)
        self.log(name, loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


def _stored_as_named(folder: Path, cut: Any) -> bool:
    """Whether every tensor of the folder names a tensor of the model through the key map (transformers 5
    stores a MoE's experts one by one while the model holds them fused: those names name nothing)."""
    try:
        keys = open_weights(folder, verify=False).index()
    except (OSError, ValueError):
        return True  # no weights found: the strategy's read says what is missing
    names = {f"layers.{name}" for name in nn.Sequential(*cut.blocks).state_dict()}
    weights = PretrainedWeights(folder, key_map=dict(cut.prefixes))
    return all(any(target in names for target in weights.targets(key)) for key in keys)


def _attn(attn_implementation: Union[str, None]) -> dict[str, str]:
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}
