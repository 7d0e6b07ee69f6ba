"""DeepSpeed's pipeline engine behind the pack's contract: the strategy, the engine's build and config, the
micro-batches, the checkpoint state both engines read, what the engine refuses, and DeepSpeed's private
names (``compat``)."""
