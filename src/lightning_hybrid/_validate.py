"""Constructor argument checks shared by the pack's components: fail at construction, say the value and the fix.

Types are checked strictly (``True`` is not an integer, ``2.5`` is not a count, ``nan`` is not a number of
minutes), because LightningCLI and YAML hand over whatever the user typed.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

__all__ = ["check_bool", "check_choice", "check_int", "check_number"]


def _fail(name: str, what: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"{name} must be {what}, got {value!r}{f'; {fix}' if fix else ''}.")


def check_int(name: str, value: Any, *, minimum: int, optional: bool = False, fix: str = "") -> Any:
    if value is None and optional:
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _fail(name, f"an integer >= {minimum}" + (" or None" if optional else ""), value, fix)
    return value


def check_number(
    name: str, value: Any, *, minimum: float, inclusive: bool = True, optional: bool = False, fix: str = ""
) -> Any:
    if value is None and optional:
        return value
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= minimum if inclusive else value > minimum)
    )
    if not ok:
        bound = f"{'>=' if inclusive else '>'} {minimum:g}"
        raise _fail(name, f"a finite number {bound}" + (" or None" if optional else ""), value, fix)
    return value


def check_bool(name: str, value: Any, *, optional: bool = False) -> Any:
    if (value is None and optional) or isinstance(value, bool):
        return value
    raise _fail(name, "True or False" + (" or None" if optional else ""), value, "")


def check_choice(name: str, value: Any, choices: Collection[Any], *, fix: str = "") -> Any:
    # True == 1: a bool is a valid choice only where the choices name it
    ok = any(c is value for c in choices) if isinstance(value, bool) else value in choices
    if not ok:
        raise _fail(name, "one of " + ", ".join(repr(c) for c in choices), value, fix)
    return value
