"""``option``: a config dataclass field with its CLI help text (``pd.cli`` builds flags from it)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import field
from typing import Any


def option(
    default: Any,
    help: str | None,  # argparse's names
    aliases: tuple[str, ...] = (),
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A field with its CLI help text (``pd.cli`` builds flags from these, and only from these),
    other flags that set it (``aliases``, e.g. ``("--tp",)``), a flag name other than the
    field's (``flag``, e.g. ``"prefill"`` for ``num_prefill``), the values it takes
    (``choices``) and how a flag's text becomes its value (``parse``; else from the type). A
    dict default is copied for each instance."""
    metadata: dict[str, Any] = {"help": help, "aliases": aliases}
    metadata.update(
        (k, v) for k, v in (("flag", flag), ("choices", choices), ("parse", parse)) if v is not None
    )
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def json_numbers(text: str) -> dict[str, float]:
    """A flag's JSON object of names to numbers (e.g. Ray resources: ``{"prefill": 1}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        raise argparse.ArgumentTypeError(f'want an object like {{"prefill": 1}}, got {text}')
    return {str(k): float(v) for k, v in value.items()}
