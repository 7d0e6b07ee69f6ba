"""A small decoder-only transformer language model that honours the pipeline contract.

The model keeps its pipeline-splittable blocks, in order, in ``self.layers`` (token embedding, transformer
blocks, output head), defines ``pipeline_loss`` and trains unchanged under ``strategy="ddp"``. It is the
example every part of lightning-hybrid is shown and tested with.

Run it with LightningCLI::

    python examples/gpt.py fit --config examples/configs/ddp.yaml
    python examples/gpt.py fit --config examples/configs/hybrid.yaml
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

import lightning_hybrid  # noqa: F401  (registers the "hybrid" strategy names)
from lightning_hybrid.optim import LAMB, LARS
from lightning_hybrid.strategies import seeded_init

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


# ----------------------------------------------------------------------------------------------- data


class CharDataset(Dataset):
    """Fixed-length windows of a character stream: ``(ids[i:i+T], ids[i+1:i+T+1])``."""

    def __init__(self, ids: Tensor, block_size: int, stride: int) -> None:
        if len(ids) <= block_size:
            raise ValueError(f"text of {len(ids)} characters is too short for block_size={block_size}")
        self.ids = ids
        self.block_size = block_size
        self.starts = list(range(0, len(ids) - block_size - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        s = self.starts[index]
        chunk = self.ids[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(L.LightningDataModule):
    """Character-level language modelling on a small public-domain corpus shipped with the project.

    Args:
        data_path: a UTF-8 text file; defaults to ``examples/data/corpus.txt``.
        block_size: sequence length of one sample.
        batch_size: samples per batch on each data-parallel replica.
        stride: distance between the starts of consecutive training windows.
        val_fraction: the tail of the text held out for validation.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        *,
        data_path: str | None = None,
        block_size: int = 64,
        batch_size: int = 16,
        stride: int = 8,
        val_fraction: float = 0.2,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        text = Path(data_path or DEFAULT_CORPUS).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n_val = max(int(len(ids) * val_fraction), block_size + 2)
        self.train_set = CharDataset(ids[:-n_val], block_size, stride)
        self.val_set = CharDataset(ids[-n_val:], block_size, max(1, block_size // 4))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.batch_size,
            drop_last=True,
            num_workers=self.hparams.num_workers,
        )

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


# ---------------------------------------------------------------------------------------------- model


class TokenEmbedding(nn.Module):
    """First pipeline block: token ids ``(B, T)`` to hidden states ``(B, T, C)``."""

    def __init__(self, vocab_size: int, d_model: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(block_size, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.dropout(self.token(idx) + self.position(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head, self.head_dim = n_head, d_model // n_head
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        # heads counted from the projections' width: a tensor-parallel rank holds n_head / T of them
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    """Last pipeline block: hidden states to next-token logits ``(B, T, V)``."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln_f(x))


class GPT(L.LightningModule):
    """Decoder-only transformer LM (nanoGPT-style) written to the lightning-hybrid pipeline contract.

    Args:
        vocab_size: number of distinct tokens (linked from the data module under LightningCLI).
        block_size: the longest sequence the position embedding covers.
        n_layer: transformer blocks; ``self.layers`` holds ``n_layer + 2`` pipeline blocks.
        n_head: attention heads per block.
        d_model: hidden size.
        dropout: dropout probability (keep 0.0 to compare pipelined runs with unpipelined ones exactly).
        lr: peak learning rate.
        weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
        momentum: SGD's momentum (its optimizer state).
        optimizer: ``"adamw"``, ``"sgd"`` (plain SGD makes exactness checks easy to reason about), or the
            layer-wise ``"lamb"`` / ``"lars"`` of :mod:`lightning_hybrid.optim` (large-batch training).
        warmup_steps: linear LR warm-up before a cosine decay to 10% at ``max_steps`` (0 keeps LR constant).
        max_steps: length of the cosine schedule.
        build_on_meta: build the blocks on the meta device in ``configure_model`` (nothing allocated);
            ``HybridParallelStrategy`` materialises only each rank's own blocks, one at a time, and calls
            :meth:`init_block` on each. The initial weights are the same either way.
        tie_embeddings: the output projection is the token embedding (GPT-2's tying): one parameter in the
            first and the last block. ``HybridParallelStrategy`` keeps it one parameter across pipeline stages.
            Not with ``build_on_meta`` (a tie made on the meta device would not survive block-by-block
            materialisation; the strategy refuses it).
        sequence_parallel: with ``tensor_parallel_size > 1``, split the hidden states between the split layers
            by sequence position too (see :meth:`tensor_parallel_plan`); the sequence length must be divisible
            by the tensor-parallel size.
        loss_parallel: with ``tensor_parallel_size > 1``, keep the head's logits split by vocabulary and compute
            the cross-entropy on the split (torch's loss parallelism): no rank holds the whole ``(B, T, V)``.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 96,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        optimizer: str = "adamw",
        warmup_steps: int = 0,
        max_steps: int = 1000,
        build_on_meta: bool = False,
        tie_embeddings: bool = False,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.val_perplexity = Perplexity()
        self.layers: nn.Sequential | None = None
        if not build_on_meta:
            self.layers = self._build_layers()
            for name, block in self.layers.named_children():
                with seeded_init(f"layers.{name}"), torch.no_grad():
                    self.init_block(f"layers.{name}", block)
            self._tie()

    def _tie(self) -> None:
        if self.hparams.tie_embeddings:
            self.layers[-1].head.weight = self.layers[0].token.weight

    def _build_layers(self) -> nn.Sequential:
        hp = self.hparams
        return nn.Sequential(
            TokenEmbedding(hp.vocab_size, hp.d_model, hp.block_size, hp.dropout),
            *(Block(hp.d_model, hp.n_head, hp.dropout) for _ in range(hp.n_layer)),
            LMHead(hp.d_model, hp.vocab_size),
        )

    def configure_model(self) -> None:
        if self.layers is None:  # build_on_meta: the strategy allocates and initialises this rank's blocks
            with torch.device("meta"):
                self.layers = self._build_layers()
            self._tie()
        if any(isinstance(v, Tensor) and v.is_meta for v in vars(self.val_perplexity).values()):
            # built under Trainer.init_module(empty_init=True): a metric's states are not weights, build it again
            self.val_perplexity = Perplexity()

    def init_block(self, name: str, block: nn.Module) -> None:
        """Initialise one block of ``self.layers`` in place (GPT-2's scheme: N(0, 0.02), residual projections
        scaled by ``1/sqrt(2 * n_layer)``, zero biases, unit LayerNorms).

        Called under :func:`~lightning_hybrid.strategies.seeded_init` (a generator seeded from the run's seed
        and the block's name), so every layout, and a meta-built model, starts from the same weights.
        """
        for sub in block.modules():
            if isinstance(sub, nn.LayerNorm):
                sub.reset_parameters()
        for pname, p in block.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.hparams.n_layer) if pname.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif pname.endswith("bias"):
                nn.init.zeros_(p)

    def tensor_parallel_plan(self, name: str, block: nn.Module) -> dict:
        """How each block splits over ``tensor_parallel_size`` ranks (Megatron's scheme): attention heads and
        the MLP's hidden units column-wise in, row-wise out; a vocabulary-parallel token embedding and output
        head (tied, when ``tie_embeddings``, as one split parameter); norms and positions whole.

        With ``sequence_parallel`` the hidden states between the split layers are split by sequence position
        (Megatron's sequence parallelism, torchtitan's plan): the norms run on each rank's positions, each
        split region gathers the sequence first and scatters its sum back (a reduce-scatter in place of an
        all-reduce), and the head gathers the sequence before its logits."""
        tp = self.device_mesh["tensor_parallel"].size()  # the strategy's mesh, as Lightning attaches it
        if self.hparams.n_head % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide n_head ({self.hparams.n_head})")
        sequence = self.hparams.sequence_parallel
        split_out = {"output_layouts": Shard(1)} if sequence else {}
        if isinstance(block, TokenEmbedding):
            plan = {"token": RowwiseParallel(input_layouts=Replicate())}
            if sequence:  # each rank keeps its positions from here on
                plan["dropout"] = PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                )
            return plan
        if isinstance(block, Block):
            plan = {
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(**split_out),
                "mlp.0": ColwiseParallel(),
                "mlp.2": RowwiseParallel(**split_out),
            }
            if sequence:
                gather = {
                    "input_layouts": (Shard(1),),
                    "desired_input_layouts": (Replicate(),),
                    "use_local_output": True,
                }
                plan.update(
                    {"ln_1": SequenceParallel(), "attn": PrepareModuleInput(**gather), "ln_2": SequenceParallel()}
                )
                plan["mlp"] = PrepareModuleInput(**gather)
            return plan
        # the logits gathered, or kept split by vocabulary for a vocabulary-parallel loss (a DTensor: the strategy
        # runs the loss and its backward under torch's loss_parallel())
        logits = {"output_layouts": Shard(-1), "use_local_output": False} if self.hparams.loss_parallel else {}
        inputs = {"input_layouts": Shard(1)} if sequence else {}
        head = ColwiseParallel(**{"output_layouts": Replicate(), **inputs, **logits})
        return {"ln_f": SequenceParallel(), "head": head} if sequence else {"head": head}

    def forward(self, idx: Tensor) -> Tensor:
        return self.layers(idx)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean next-token cross-entropy over the micro-batch (the pipeline contract's loss). On logits split by
        vocabulary (``loss_parallel``) it is computed on the split and comes back a replicated DTensor: its local
        value is the loss, a plain tensor for logging and metrics (the graph runs through it)."""
        loss = F.cross_entropy(output.flatten(0, 1).float(), target.flatten())
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        loss = self.pipeline_loss(self(inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, target = batch
        return self.pipeline_validation_step(self(inputs), target, batch_idx)

    def pipeline_validation_step(self, output: Tensor, target: Tensor, batch_idx: int) -> Tensor:
        """Loss and torchmetrics perplexity from the model's output.

        Under a pipeline, HybridParallelStrategy calls this on every rank with the last stage's output, so
        metric states update (and synchronise) everywhere; without one, ``validation_step`` calls it.
        """
        loss = self.pipeline_loss(output, target)
        if isinstance(output, DTensor):  # logits split by vocabulary (loss_parallel): the metric takes them whole
            output = output.full_tensor()
        self.val_perplexity.update(output.float(), target)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_perplexity, prog_bar=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        elif hp.optimizer == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        elif hp.optimizer == "lamb":
            optimizer = LAMB(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        elif hp.optimizer == "lars":
            optimizer = LARS(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            raise ValueError(f"optimizer must be 'adamw', 'sgd', 'lamb' or 'lars', got {hp.optimizer!r}")
        if hp.warmup_steps <= 0:
            return optimizer

        def lr_lambda(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------------------------- CLI


class GPTCLI(LightningCLI):
    """LightningCLI that takes ``vocab_size`` from the data module."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")

    def after_fit(self) -> None:
        trainer = self.trainer
        if trainer.global_rank != 0:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        strategy = trainer.strategy
        layout = getattr(strategy, "layout", None)
        lines = [
            "",
            "=" * 72,
            "Training summary",
            f"  strategy          {type(strategy).__name__}"
            + (
                f" (pipeline x data = {layout.pipeline_parallel_size} x {layout.data_parallel_size},"
                f" zero_stage={layout.zero_stage}, schedule={layout.schedule})"
                if layout is not None
                else ""
            ),
            f"  processes         {trainer.world_size} on {trainer.strategy.root_device.type}",
            f"  optimizer steps   {trainer.global_step}",
        ]
        for key in ("train_loss", "val_loss", "val_ppl"):
            if key in metrics:
                lines.append(f"  {key:<17} {metrics[key]:.4f}")
        plugin = trainer.precision_plugin
        if hasattr(plugin, "loss_scale"):
            name = type(plugin).__name__
            lines.append(f"  loss scale        {plugin.loss_scale:g} ({name}, {plugin.skipped_steps} skipped steps)")
        for callback in trainer.callbacks:
            if type(callback).__name__ == "AccumulationScheduler":
                lines.append(
                    f"  accumulation      K={callback.accumulate_grad_batches}, effective batch"
                    f" {callback.effective_batch_size} samples"
                )
            if type(callback).__name__ == "FaultTolerantCheckpoint":
                lines.append(f"  resumed from      {callback.resumed_from or '- (fresh start)'}")
                lines.append(f"  last checkpoint   {callback.last_model_path or '-'}")
                lines.append(f"  non-finite steps  {callback.nonfinite_steps} (rollbacks {callback.rollbacks})")
        lines.append("=" * 72)
        print("\n".join(lines), flush=True)


def main() -> None:
    GPTCLI(GPT, CharDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
