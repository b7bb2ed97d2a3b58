"""The flags page stays true to the code: docs/flags.md's tables are the parser's
(``scripts/cli_flags.py``), every flag of ``pd serve`` is in them, and README.md links the page."""

from __future__ import annotations

from scripts.cli_flags import FLAGS_DOC, _serve_parser, doc_block, tables


def test_the_flag_tables_are_the_parsers() -> None:
    assert doc_block(FLAGS_DOC.read_text()) == tables(), (
        "docs/flags.md's flag tables are stale: run python scripts/cli_flags.py --write"
    )


def test_every_serve_flag_is_in_a_group() -> None:
    block = tables()
    for action in _serve_parser()._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in block, flag


def test_the_readme_links_the_flags_page() -> None:
    assert "(docs/flags.md)" in (FLAGS_DOC.parents[1] / "README.md").read_text()
