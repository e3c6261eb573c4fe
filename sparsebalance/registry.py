"""Name -> implementation maps for the extension points (packing strategies, DST
policies; the kernel backends are ``sparsebalance.ops.BACKENDS``).

The driver's flag choices are a registry's keys, so adding an implementation is its
own file plus one line in its registry (docs/design.md lists the extension points).
"""

from __future__ import annotations

from typing import Dict, Generic, TypeVar

T = TypeVar("T")


class Registry(Dict[str, T], Generic[T]):
    """A dict of named implementations whose :meth:`pick` names the choices on a miss."""

    def __init__(self, kind: str, entries: Dict[str, T]) -> None:
        super().__init__(entries)
        self.kind = kind
        """What one entry is, for error messages ("strategy", "DST policy")."""

    def pick(self, name: str) -> T:
        """The entry called ``name``; ValueError listing the registered names if none."""
        try:
            return self[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.kind} must be one of {sorted(self)}, got {name!r}") from None
