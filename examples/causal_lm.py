"""Train a Hugging Face causal LM with lightning-hybrid through LightningCLI, then export it.

The model is ``lightning_hybrid.models.CausalLM``; the data is the example corpus as character ids (nothing
is downloaded). At the end the trained weights are written as a ``save_pretrained`` folder
(``--export_dir``) that ``AutoModelForCausalLM.from_pretrained`` loads::

    python examples/causal_lm.py fit --config examples/configs/llama.yaml
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gpt import CharDataModule
from lightning.pytorch.cli import LightningCLI

from lightning_hybrid.models import CausalLM
from lightning_hybrid.utilities import export_pretrained


class CausalLMCLI(LightningCLI):
    """LightningCLI that exports the trained model as a ``save_pretrained`` folder after ``fit``."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--export_dir", default="runs/llama/hf", help="where the save_pretrained folder goes")

    def after_fit(self) -> None:
        trainer = self.trainer
        export_dir = Path(self.config.fit.export_dir)
        checkpoint = export_dir.parent / "final"
        if trainer.is_global_zero:  # this example's own outputs of an earlier run
            for old in (checkpoint, export_dir):
                shutil.rmtree(old, ignore_errors=True)
        trainer.strategy.barrier()
        trainer.save_checkpoint(checkpoint, weights_only=False)  # every rank: a sharded folder in any layout
        trainer.strategy.barrier()
        if trainer.is_global_zero:
            export_pretrained(checkpoint, export_dir)
            print(f"exported {export_dir} (AutoModelForCausalLM.from_pretrained loads it)")


def main() -> None:
    CausalLMCLI(CausalLM, CharDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
