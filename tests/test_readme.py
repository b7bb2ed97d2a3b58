"""README.md stays true to the code: its flag tables are the parser's (``scripts/cli_flags.py``),
and every flag of ``pd serve`` is in them."""

from __future__ import annotations

from scripts.cli_flags import README, _serve_parser, readme_block, tables


def test_readmes_flag_tables_are_the_parsers() -> None:
    assert readme_block(README.read_text()) == tables(), (
        "README.md's flag tables are stale: run python scripts/cli_flags.py --write"
    )


def test_every_serve_flag_is_in_a_group() -> None:
    block = tables()
    for action in _serve_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in block, flag
