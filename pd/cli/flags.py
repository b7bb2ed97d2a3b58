"""Flags read off config dataclasses: one ``--flag`` per ``option()`` field
(``add_dataclass_args``), in the help's groups, and the dataclass built back from the parsed
flags (``dataclass_from_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

AUTOSCALE_PREFIX = "autoscale_"  # --autoscale-*; some fields name their own flag
# The groups of ``pd serve --help`` (and of docs/flags.md's tables), in order
GROUPS = (
    "server", "engine", "cache tiers", "speculation", "routing", "cluster and Ray",
    "autoscaling", "security and limits",
)  # fmt: skip


def groups_of(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    """The parser's argument groups by title, made (in ``GROUPS``' order) on first use."""
    groups = getattr(parser, "_pd_groups", None)
    if groups is None:
        groups = {title: parser.add_argument_group(title) for title in GROUPS}
        parser._pd_groups = groups  # type: ignore[attr-defined]
    return groups


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    only: tuple[str, ...] | None = None,
    group: str | dict[str, str] = "engine",
) -> None:
    """One ``--flag`` per ``option`` field (``--{prefix}{field}``, or the field's ``flag``
    metadata; only the fields in ``only`` if given); default, type, choices and help read from
    the dataclass, in the help's ``group`` (a title, or field -> title with "engine" for the
    others). The value lands in ``args.{prefix}{field}`` either way (``dataclass_from_args``)."""
    groups = groups_of(parser)
    for f in _option_fields(cls):
        if only is not None and f.name not in only:
            continue
        title = group if isinstance(group, str) else group.get(f.name, "engine")
        add = groups[title].add_argument
        name = f.metadata.get("flag", prefix + f.name)
        flags = ("--" + name.replace("_", "-"), *(() if prefix else f.metadata["aliases"]))
        dest, help_ = prefix + f.name, f.metadata["help"]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if isinstance(default, bool):
            add(
                *flags,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_,
                dest=dest,
            )
        elif isinstance(default, tuple):  # repeatable; the dataclass gets a tuple
            add(*flags, action="append", default=None, help=help_, dest=dest)
        else:
            kind = f.metadata.get("parse") or (
                int if "int" in str(f.type) else float if "float" in str(f.type) else str
            )
            # a field naming its own flag shows it (--prefill PREFILL, not NUM_PREFILL)
            metavar = name.upper() if "flag" in f.metadata and not prefix else None
            add(
                *flags,
                type=kind,
                default=default,
                help=help_,
                dest=dest,
                choices=f.metadata.get("choices"),
                metavar=metavar,
            )


def _option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` declared with ``option()``: its flags."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]  # type: ignore[arg-type]


def dataclass_from_args(
    cls: type[T], args: argparse.Namespace, prefix: str = "", **fields: Any
) -> T:
    """``cls`` built from the flags ``add_dataclass_args`` added, ``fields`` in place of
    theirs (other fields: defaults)."""
    given = vars(args)
    names = [f.name for f in _option_fields(cls)]
    return cls(**{n: given[prefix + n] for n in names if prefix + n in given} | fields)
