"""The torch engine's data-parallel techniques, one ZeRO stage each: gradient synchronisation per stage
(``grad_sync``), the flat sharded optimizer and flat gradients of ZeRO-1/2, FSDP2 for ZeRO-3, and module
buffers kept as DDP keeps them."""
