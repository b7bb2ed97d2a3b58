"""docs/flags.md's tables of ``pd serve``'s flags, one per group of ``pd serve --help``, made from
the parser itself (so the page cannot drift from the code; tests/test_readme.py checks it).

    python scripts/cli_flags.py            # print the tables
    python scripts/cli_flags.py --write    # replace docs/flags.md's block between the markers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pd.cli import build_parser
from pd.cli.flags import GROUPS

FLAGS_DOC = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
BEGIN, END = "<!-- flags:begin (scripts/cli_flags.py) -->", "<!-- flags:end -->"


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == [] or value == {} or value == ():
        return "-"
    if isinstance(value, bool):
        return f"`{'on' if value else 'off'}`"
    return f"`{value}`"


def tables() -> str:
    """The markdown tables, one per group that has flags."""
    out: list[str] = []
    for group in _serve_parser()._action_groups:
        if group.title not in GROUPS or not group._group_actions:
            continue
        out += [f"**{group.title}**", "", "| flag | default | |", "|---|---|---|"]
        for action in group._group_actions:
            flags = " / ".join(f"`{f}`" for f in action.option_strings)
            help_ = (action.help or "").replace("|", "\\|")
            out.append(f"| {flags} | {_default(action)} | {help_} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def doc_block(text: str) -> str:
    """What docs/flags.md holds between the markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n") + "\n"


def main() -> int:
    block = tables()
    if "--write" not in sys.argv[1:]:
        print(block, end="")
        return 0
    text = FLAGS_DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    FLAGS_DOC.write_text(text[:start] + "\n" + block + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
