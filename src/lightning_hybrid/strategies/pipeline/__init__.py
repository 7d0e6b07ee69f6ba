"""The torch engine's pipeline: cutting ``self.layers`` into stages, running a torch schedule inside
``training_step``, losses that are a mean over a count, and parameters tied across stages."""
