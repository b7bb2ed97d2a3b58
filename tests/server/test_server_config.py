"""The flags of the slow-client deadlines, the connection limits, the graceful shutdown and
TLS: checked when the config is built (before anything starts), and reaching ``ServerConfig``
from ``pd serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pd.cli import build_parser, server_config
from pd.server import ServerConfig


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stream_write_timeout_s": 0.0}, "stream_write_timeout_s must be > 0 seconds, got 0"),
        ({"body_read_timeout_s": -1.0}, "body_read_timeout_s must be > 0 seconds, got -1"),
        ({"shutdown_grace_s": 0.0}, "shutdown_grace_s must be > 0 seconds"),
        ({"header_timeout_s": 0.0}, "header_timeout_s must be > 0 seconds, got 0"),
        ({"max_connections": -1}, "max_connections must be >= 0, got -1"),
        ({"max_body_bytes_in_flight": 1 << 20}, r"\(1048576\) must be at least max_body_bytes"),
        ({"ssl_certfile": "cert.pem"}, "both ssl_certfile and ssl_keyfile, or neither"),
        ({"ssl_keyfile": "key.pem"}, "both ssl_certfile and ssl_keyfile, or neither"),
        ({"ssl_certfile": "/nonexistent/c", "ssl_keyfile": "/nonexistent/k"}, "no such TLS"),
    ],
)
def test_bad_values_are_refused_when_the_config_is_built(
    kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ServerConfig(**kwargs)


def test_pd_serve_flags_reach_the_server_config(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    args = build_parser().parse_args(
        [
            "serve", "--stream-write-timeout-s", "5", "--body-read-timeout-s", "7",
            "--shutdown-grace-s", "11", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
            "--header-timeout-s", "3", "--max-connections", "100",
            "--max-body-bytes-in-flight", "9000000",
        ]
    )  # fmt: skip
    cfg = server_config(args)
    assert (cfg.header_timeout_s, cfg.max_connections, cfg.max_body_bytes_in_flight) == (
        3, 100, 9_000_000,
    )  # fmt: skip
    assert (cfg.stream_write_timeout_s, cfg.body_read_timeout_s, cfg.shutdown_grace_s) == (5, 7, 11)
    assert (cfg.ssl_certfile, cfg.ssl_keyfile) == (str(cert), str(key))
    defaults = server_config(build_parser().parse_args(["serve"]))
    assert (defaults.stream_write_timeout_s, defaults.body_read_timeout_s) == (30.0, 30.0)
    assert defaults.shutdown_grace_s == 30.0 and defaults.ssl_certfile is None
    assert (defaults.header_timeout_s, defaults.max_connections) == (10.0, 0)
