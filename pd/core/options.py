"""``option``: a config dataclass field with its CLI help text (``pd.cli`` builds flags from it)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, aliases: tuple[str, ...] = ()) -> Any:  # argparse's names
    """A field with its CLI help text (``pd.cli`` builds flags from these) and other flags
    that set it (``aliases``, e.g. ``("--tp",)``)."""
    return field(default=default, metadata={"help": help, "aliases": aliases})
