"""The on-disk checkpoint format of lightning-hybrid, shared by the strategies, the checkpoint callback and
``consolidate_checkpoint``.

Trust model: a checkpoint folder is data, never code. Nothing in it is unpickled beyond tensors and plain
values, manifests are parsed as hostile input, the pack deletes only names it created (never through a
link), and every file it writes is durable before it gets its real name.

- ``_files``: durable, hashed writes (temporary name, flush, fsync, rename, directory fsync).
- ``_safe_load``: reading ``torch.save`` payloads and DCP indexes without running code.
- ``_format``: the folder's contents and the manifest (parse, verify).
- ``_sharded``: the DCP split of a Lightning checkpoint, written and read.
- ``_store``: step folders, the ``last.ckpt`` pointer, clean-up and retention.
"""
