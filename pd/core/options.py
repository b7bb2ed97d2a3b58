"""``option``: a config dataclass field with its CLI help text (``pd.cli`` builds flags from it)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str) -> Any:  # "help": argparse's name
    """A field with its CLI help text (``pd.cli`` builds flags from these)."""
    return field(default=default, metadata={"help": help})
