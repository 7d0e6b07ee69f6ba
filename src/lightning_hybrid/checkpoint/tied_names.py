"""Where a checkpoint stores a parameter tied across blocks (one Parameter under several names): once, under its
first name, in the model state and in the flat optimizer state alike. Every writer and reader of the pack's
checkpoints (both engines, ``init_from``, ``consolidate_checkpoint``) maps names through this."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_hybrid.contract import Tie

__all__ = ["CheckpointNames"]

_SECTIONS = ("state.", "param_groups.")  # the flat optimizer state's keys: <section><name>.<key>


class CheckpointNames:
    """Where a checkpoint stores each tied parameter: under its first name only.

    Keys are a model state's names (``layers.5.head.weight``) or the flat optimizer state's
    (``state.<name>.<key>``, ``param_groups.<name>.<key>``)."""

    def __init__(self, ties: Iterable[Tie] = ()) -> None:
        self.aliases = {name: tie.names[0] for tie in ties for name in tie.names[1:]}

    def stored_key(self, key: str) -> str:
        """The key the checkpoint holds ``key``'s value under."""
        for alias, first in self.aliases.items():
            if key == alias:
                return first
            for section in _SECTIONS:
                if key.startswith(section + alias + "."):
                    return section + first + key[len(section + alias) :]
        return key

    def to_store(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` without the values of tied parameters under names other than their first."""
        return {k: v for k, v in state.items() if self.stored_key(k) == k}

    def to_read(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """``state`` keyed by where the checkpoint stores each value (a value whose stored key this rank also
        holds is left out: it is the same tensor), and the way back: stored key -> local key."""
        out, back = {}, {}
        for key, value in state.items():
            stored = self.stored_key(key)
            if stored != key and stored in state:
                continue
            out[stored], back[stored] = value, key
        return out, back

    def to_json(self) -> list[list[str]]:
        groups: dict[str, list[str]] = {}
        for alias, first in self.aliases.items():
            groups.setdefault(first, [first]).append(alias)
        return list(groups.values())

    @classmethod
    def from_json(cls, groups: Iterable[Iterable[str]]) -> CheckpointNames:
        return cls(Tie(tuple(names), ()) for names in groups)
