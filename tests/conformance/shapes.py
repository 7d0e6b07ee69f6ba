"""The catalogue: model shapes real models have, each a small LightningModule in the pipeline contract.

Every shape keeps its blocks in ``self.layers`` (at least two, so a pipeline can cut it), defines
``pipeline_loss`` (a mean over the micro-batch) and trains unchanged in one process. What each one
exercises is in its docstring; :data:`SHAPES` names them. A shape may also say which callbacks, Trainer
arguments and optimizer it trains with, and whether its reference must see each replica's micro-batches
apart (``per_chunk_statistics``: BatchNorm, whose batch statistics depend on the split).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, LearningRateMonitor, StochasticWeightAveraging
from torch import Tensor, nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import TensorDataset

GLOBAL_BATCH = 8  # samples per optimizer step, whatever the layout
STEPS_PER_EPOCH = 3
MAX_STEPS = 8
CHECKPOINT_AT = 5  # mid-epoch 1: after BackboneFinetuning added its group, with SWA averaging


OPTIMIZERS = ("adamw", "sgd")

OWN_LOSSES: list[float] = []
"""Every micro-batch loss ``pipeline_loss`` computed in this process while training, in order: a rank's own
losses, before anything is reduced over the replicas (the worker clears it before each run)."""


class Shape(L.LightningModule):
    """The base of every shape: blocks in ``self.layers``, a mean loss, the data as one TensorDataset, and one
    of two optimizers (``optimizer_name``, set by :func:`build`): AdamW with weight decay (a parameter stepped
    with a zero gradient would move), or plain SGD with momentum and weight decay, whose update is
    proportional to the gradient (AdamW is nearly blind to a constant factor on it: a gradient twice too large
    moves AdamW's weights by 1e-6, SGD's by the update itself)."""

    lr = 0.02
    sgd_lr = 0.05
    weight_decay = 0.1
    eps = 1e-8
    accumulate = 1
    loss_tolerance, weight_tolerance = 1e-5, 1e-4
    per_chunk_statistics = False
    samples = GLOBAL_BATCH * STEPS_PER_EPOCH
    optimizers_tested: tuple[str, ...] = OPTIMIZERS
    # the reference trains with Lightning's own accumulation over global micro-batches (an epoch whose last
    # window is partial) instead of one process step on the whole window
    lightning_accumulation = False

    def __init__(self) -> None:
        super().__init__()
        self.optimizer_name = "adamw"

    def forward(self, x: Tensor) -> Tensor:
        for block in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            x = block(x)
        return x

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output.float(), target.float())

    def tensor_parallel_plan(self, name: str, block: nn.Module) -> dict[str, Any]:
        """Under tensor parallelism: every ``nn.Linear`` of a block split by its outputs, and every
        ``nn.Embedding`` by its rows, the output gathered (exact whatever follows; most weights split)."""
        size = self.device_mesh["tensor_parallel"].size()
        plan: dict[str, Any] = {}
        for sub, module in block.named_modules():
            if isinstance(module, nn.Linear) and module.out_features % size == 0:
                plan[sub] = ColwiseParallel(output_layouts=Replicate())
            elif isinstance(module, nn.Embedding) and module.num_embeddings % size == 0:
                plan[sub] = RowwiseParallel(input_layouts=Replicate())
        return plan

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return self.make_optimizer([p for p in self.parameters() if p.requires_grad])

    def make_optimizer(self, params: Any, **defaults: Any) -> torch.optim.Optimizer:
        """The shape's optimizer over ``params`` (a list, or param groups with their own settings)."""
        if self.optimizer_name == "sgd":
            if "lr" in defaults:
                defaults["lr"] = defaults["lr"] / self.lr * self.sgd_lr
            else:
                defaults["lr"] = self.sgd_lr
            for group in params if params and isinstance(params[0], dict) else []:
                if "lr" in group:
                    group["lr"] = group["lr"] / self.lr * self.sgd_lr
            return torch.optim.SGD(params, **{"momentum": 0.9, "weight_decay": self.weight_decay, **defaults})
        return torch.optim.AdamW(
            params, **{"lr": self.lr, "weight_decay": self.weight_decay, "eps": self.eps, **defaults}
        )

    def trainer_kwargs(self, reference: bool = False) -> dict[str, Any]:
        """Trainer arguments the shape trains with (precision, clipping): in every layout, and in the one-process
        reference (``reference=True``: Lightning's own plugins where the layouts use the pack's)."""
        return {}

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.samples, 8, generator=g)
        return TensorDataset(x, torch.tanh(x[:, :4] * 1.5 + 0.3))

    def callbacks(self) -> list[Callback]:
        return []


class ScaledTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.7))  # 0-dim, as CLIP's
        self.shift = nn.Parameter(torch.zeros(16))  # 1-D

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.logit_scale.exp() + self.shift)


class Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4)
        self.temperature = nn.Parameter(torch.tensor(1.3))  # 0-dim

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x) / self.temperature


class ScalarParams(Shape):
    """0-dim parameters (CLIP's ``logit_scale``, a learnable temperature) and 1-D ones."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), ScaledTanh(), Temperature())


class RoutedExperts(nn.Module):
    """Top-1 routing over four experts by a 'kind' the input carries: which experts a rank uses depends on
    the samples it got; expert 3's kind is rare, so some steps use it on one rank only, some on none."""

    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        with torch.no_grad():
            self.gate.weight.zero_()
            self.gate.weight[:, :experts] = torch.eye(experts) * 4.0
        self.used: set[int] = set()

    def forward(self, x: Tensor) -> Tensor:
        scores = self.gate(x).softmax(-1)
        choice = scores.argmax(-1)
        out = torch.zeros_like(x)
        self.used = set()
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                self.used.add(e)
                out = out.index_add(0, rows, expert(x[rows]) * scores[rows, e : e + 1])
        return x + out


class KindInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 12)

    def forward(self, x: Tensor) -> Tensor:
        # the first four features say the kind (one-hot, unchanged); the rest is learned
        return torch.cat([x[:, :4] * 3.0, torch.tanh(self.proj(x))], dim=-1)


class Experts(Shape):
    """Routed experts: data-dependent and rank-dependent use (MoE)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(KindInput(), RoutedExperts(), nn.Linear(16, 4))

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(2)
        kinds = torch.multinomial(torch.tensor([0.4, 0.3, 0.22, 0.08]), self.samples, replacement=True, generator=g)
        x = torch.randn(self.samples, 8, generator=g)
        x[:, :4] = F.one_hot(kinds, 4).float()
        return TensorDataset(x, torch.tanh(x[:, 4:8] + kinds[:, None].float() * 0.2))


class WithPooler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)
        self.pooler = nn.Linear(16, 16)  # never used in training (BERT's pooler under MLM only)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x)


class UnusedEverywhere(Shape):
    """Parameters no rank ever uses: they must not move (AdamW's decay would move them on a zero gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.GELU(), WithPooler())


class FrozenPart(Shape):
    """Frozen parameters still in the optimizer: a param group whose parameters are all frozen, and a frozen
    bias in the group of trainable ones."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
        self.layers[0].requires_grad_(False)
        self.layers[2].bias.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters())
        return self.make_optimizer(
            [
                {"params": [p for n, p in named if n.startswith("layers.0.")], "lr": self.lr * 2},
                {"params": [p for n, p in named if not n.startswith("layers.0.")]},
            ]
        )


class Backbone(Shape):
    """``BackboneFinetuning`` freezes the backbone, then adds it as a param group at epoch 1 (after set-up)
    and changes that group's LR every epoch; a checkpoint in epoch 1 must carry the group and its state.
    Under a pipeline the backbone is on the first stage only, which also holds trainable blocks."""

    BACKBONE = ("0",)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )

    @property
    def backbone(self) -> nn.Module:
        # the backbone blocks this rank holds (a pipeline stage may hold none)
        named = dict(self.layers.named_children())
        return nn.ModuleList(named[n] for n in self.BACKBONE if n in named)

    def callbacks(self) -> list[Callback]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, verbose=False)]


class Manual(Shape):
    """Manual optimization: an auxiliary backward whose gradients are discarded with ``optimizer.zero_grad()``
    (as GAN and SAM-style loops do), then the loss's backward, a clip by the norm (small enough to act on
    every step: it must see the replicas' mean gradient), a second loss's backward whose gradient adds to the
    clipped one (the step's gradients were made ready for the clip, and are made ready again), and the step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(self(x).pow(2).mean() * 10.0)  # discarded below
        optimizer.zero_grad()
        loss = self.pipeline_loss(self(x), y)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        self.manual_backward(self(x).pow(2).mean() * 0.1)
        optimizer.step()
        optimizer.zero_grad()
        return loss


class ParamGroups(Shape):
    """Several param groups with their own settings (embedding at a tenth of the LR, no decay on biases and
    norms); under a pipeline the embedding group is empty on the last stage. A LambdaLR schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Embedding(16, 8), nn.Flatten(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        )

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 16, (self.samples, 4), generator=g)
        return TensorDataset(tokens, torch.sin(tokens[:, :4].float()))

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters())
        embedding = [p for n, p in named if n.startswith("layers.0.")]
        no_decay = [p for n, p in named if not n.startswith("layers.0.") and (p.dim() < 2)]
        rest = [p for n, p in named if not n.startswith("layers.0.") and p.dim() >= 2]
        optimizer = self.make_optimizer(
            [
                {"params": embedding, "lr": self.lr * 0.1},
                {"params": no_decay, "weight_decay": 0.0},
                {"params": rest},
            ]
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.3 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Monitored(Shape):
    """Lightning callbacks that read param groups: ``LearningRateMonitor`` (logs every group's LR) with an
    epoch-interval StepLR."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters())
        optimizer = self.make_optimizer(
            [
                {"params": [p for n, p in named if n.startswith("layers.0.")], "lr": self.lr * 0.5},
                {"params": [p for n, p in named if not n.startswith("layers.0.")]},
            ]
        )
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def callbacks(self) -> list[Callback]:
        return [LearningRateMonitor(logging_interval="step")]


class Averaged(Shape):
    """``StochasticWeightAveraging`` from epoch 1: a copy of the model averaged each epoch, an SWALR schedule,
    and the averaged weights put back at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def callbacks(self) -> list[Callback]:
        return [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1)]


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


class BasicBlock(nn.Module):
    """torchvision's ``resnet.BasicBlock`` (conv-bn-relu-conv-bn + an identity or 1x1-conv-bn shortcut)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Stem(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn1(self.conv1(x)))


class Classifier(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ResNet(Shape):
    """A torchvision ResNet (``BasicBlock`` layers, BatchNorm buffers) at a small width, in the pipeline contract.
    torchvision's wheel on PyPI does not load beside torch's CPU build, so the blocks are torchvision's own
    code re-declared. BatchNorm behaves as under Lightning's DDP: batch statistics per replica and
    micro-batch, running statistics those of data-parallel rank 0, kept on every replica."""

    per_chunk_statistics = True

    def __init__(self, width: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            Stem(width),
            BasicBlock(width, width),
            BasicBlock(width, 2 * width, stride=2),
            Classifier(2 * width, classes),
        )

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.float(), target)

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(4)
        x = torch.randn(self.samples, 3, 8, 8, generator=g)
        return TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long())


class Layouts(nn.Module):
    """A non-contiguous parameter (a transposed view) and a channels_last convolution weight."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.randn(16, 12).t())  # 12 x 16, strides (1, 12)
        self.conv = nn.Conv2d(1, 2, 3, padding=1).to(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x[:, :12].reshape(-1, 1, 3, 4)).flatten(1)  # 24
        return torch.tanh(h[:, :12] @ self.t)


class MemoryLayouts(Shape):
    """Parameters that are not contiguous, and a ``channels_last`` one."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 12), Layouts(), nn.Linear(16, 4))


class HalfBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 16)
        self.offset = nn.Parameter(torch.full((16,), 0.25, dtype=torch.bfloat16))  # bf16 beside fp32

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x) + self.offset.float())


class MixedDtypes(Shape):
    """A bf16 parameter beside fp32 ones in the same param group. Its gradient is a bf16 tensor: where a layout
    adds micro-batches' or replicas' parts of it, each part is rounded to bf16 first (as torch accumulates a
    bf16 .grad), so the cell is judged at bf16's resolution."""

    loss_tolerance, weight_tolerance = 1e-3, 1e-2  # about 5 bf16 steps of the parameter's 0.25

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(HalfBias(), nn.Linear(16, 4))


class Tied(Shape):
    """Input and output embeddings tied (one Parameter in the first and the last block)."""

    def __init__(self) -> None:
        super().__init__()
        embed = nn.Embedding(16, 8)
        head = nn.Linear(8, 16, bias=False)
        head.weight = embed.weight
        self.layers = nn.Sequential(embed, nn.Linear(8, 8), nn.Tanh(), head)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 16, (self.samples, 5), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Router(nn.Module):
    """A block that nests ``ModuleDict``s (per-task heads inside per-branch dicts)."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleDict(
            {
                "left": nn.ModuleDict({"proj": nn.Linear(16, 8), "norm": nn.LayerNorm(8)}),
                "right": nn.ModuleDict({"proj": nn.Linear(16, 8), "norm": nn.LayerNorm(8)}),
            }
        )

    def forward(self, x: Tensor) -> Tensor:
        outs = [b["norm"](b["proj"](x)) for b in self.branches.values()]
        return torch.cat(outs, dim=-1)


class NestedDicts(Shape):
    """A block nesting ``ModuleDict``s; ``self.layers`` is itself a ``ModuleDict``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"inp": nn.Linear(8, 16), "route": Router(), "out": nn.Linear(16, 4)})


class TokenMean(Shape):
    """Base of the losses that are a mean over a variable count (padded or masked tokens): defines
    ``pipeline_loss_count``, the number of elements ``pipeline_loss``'s mean is over."""

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(), ignore_index=-100)

    def pipeline_loss_count(self, target: Tensor) -> Tensor:
        return (target != -100).sum()


class PaddedLM(TokenMean):
    """A padded language-model batch: each sequence has its own real length (1..8 tokens), the rest is
    padding with ``ignore_index``; the loss is the mean over the global batch's real tokens, with
    accumulation over two batches."""

    accumulate = 2
    samples = GLOBAL_BATCH * STEPS_PER_EPOCH * 2

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(6)
        tokens = torch.randint(0, 16, (self.samples, 9), generator=g)
        lengths = torch.randint(1, 9, (self.samples,), generator=g)
        lengths[::5] = 1  # some nearly empty sequences: their mean would weigh as much as a full one's
        target = tokens[:, 1:].clone()
        target[torch.arange(8)[None, :] >= lengths[:, None]] = -100
        return TensorDataset(tokens[:, :-1], target)


# ----------------------------------------------------------------------------------------- real models


class _HFBlock(nn.Module):
    """A Hugging Face layer whose forward returns a tuple, as a tensor-in, tensor-out block."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class GPT2(Shape):
    """Hugging Face's ``GPT2LMHeadModel`` from a config (embeddings tied), its modules as the blocks."""

    # attention's key bias has a zero gradient in exact arithmetic: Adam would turn its rounding noise into
    # full-size updates, which no two summation orders share
    eps = 1e-6

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager",
        )  # fmt: skip
        hf = GPT2LMHeadModel(config)
        embed, head = _Embed(hf.transformer.wte, hf.transformer.wpe), _Head(hf.transformer.ln_f, hf.lm_head)
        self.layers = nn.Sequential(embed, *(_HFBlock(h) for h in hf.transformer.h), head)
        assert head.lm_head.weight is embed.wte.weight

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 32, (self.samples, 9), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class _Embed(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: Tensor) -> Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class _Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class _BertHead(nn.Module):
    """BERT's pooler (unused under MLM-only training) beside its MLM head."""

    def __init__(self, pooler: nn.Module, cls: nn.Module) -> None:
        super().__init__()
        self.pooler, self.cls = pooler, cls

    def forward(self, x: Tensor) -> Tensor:
        return self.cls(x)


class _BertEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(self, ids: Tensor) -> Tensor:
        return self.embeddings(input_ids=ids)


class Bert(TokenMean):
    """Hugging Face BERT from a config: ``BertForPreTraining``'s encoder, its pooler and MLM head (decoder tied
    to the word embeddings), trained on masked-LM only, so the pooler gets no gradient; the loss is the mean
    over the masked positions (a count that differs between micro-batches)."""

    eps = 1e-6  # see GPT2

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForPreTraining

        config = BertConfig(
            vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )  # fmt: skip
        hf = BertForPreTraining(config)
        assert hf.bert.pooler is not None
        self.layers = nn.Sequential(
            _BertEmbed(hf.bert.embeddings),
            *(_HFBlock(layer) for layer in hf.bert.encoder.layer),
            _BertHead(hf.bert.pooler, hf.cls.predictions),
        )

    def dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(8)
        tokens = torch.randint(1, 32, (self.samples, 8), generator=g)
        masked = torch.rand(self.samples, 8, generator=g) < 0.25
        masked[::4, 0] = True  # every sequence of four has at least one masked token
        target = torch.where(masked, tokens, torch.full_like(tokens, -100))
        inputs = torch.where(masked, torch.zeros_like(tokens), tokens)  # token 0 stands for [MASK]
        return TensorDataset(inputs, target)


SHAPES: dict[str, Callable[[], Shape]] = {
    "scalar-params": ScalarParams,
    "routed-experts": Experts,
    "unused-everywhere": UnusedEverywhere,
    "frozen-part": FrozenPart,
    "backbone-finetuning": Backbone,
    "manual-optimization": Manual,
    "param-groups": ParamGroups,
    "lr-monitor": Monitored,
    "swa": Averaged,
    "resnet-batchnorm": ResNet,
    "memory-layouts": MemoryLayouts,
    "mixed-dtypes": MixedDtypes,
    "tied": Tied,
    "nested-moduledict": NestedDicts,
    "padded-lm": PaddedLM,
    "hf-gpt2": GPT2,
    "hf-bert": Bert,
}


def catalogue() -> dict[str, Callable[[], Shape]]:
    """Every shape: the model shapes above, then the shapes of how training runs (``shapes_training``)."""
    from shapes_hf import HF_SHAPES  # they build on this module
    from shapes_training import TRAINING_SHAPES

    return {**SHAPES, **HF_SHAPES, **TRAINING_SHAPES}


def cells() -> list[str]:
    """Every row of the matrix: ``"<shape>/<optimizer>"`` for each shape and each optimizer it trains with."""
    return [f"{name}/{opt}" for name, make in catalogue().items() for opt in make.optimizers_tested]


def build(key: str) -> Shape:
    """The shape of ``key`` (``"<shape>/<optimizer>"``, or a shape's name: AdamW) with the same initial weights
    in every process; its ``pipeline_loss`` values while training are recorded in :data:`OWN_LOSSES`."""
    name, _, optimizer = key.partition("/")
    torch.manual_seed(0)
    model = catalogue()[name]()
    model.optimizer_name = optimizer or "adamw"
    inner = model.pipeline_loss

    def pipeline_loss(output: Any, target: Tensor) -> Tensor:
        loss = inner(output, target)
        if torch.is_grad_enabled():
            OWN_LOSSES.append(float(loss.detach().float()))
        return loss

    model.pipeline_loss = pipeline_loss  # type: ignore[method-assign]
    return model
