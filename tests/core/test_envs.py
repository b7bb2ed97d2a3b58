"""pd.core.envs reads the environment at access time and rejects malformed values."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd.core import envs


def test_cache_dir_default_and_override(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PD_CACHE_DIR", raising=False)
    assert envs.PD_CACHE_DIR == Path.home() / ".cache" / "pd"
    monkeypatch.setenv("PD_CACHE_DIR", str(tmp_path))
    assert envs.PD_CACHE_DIR == tmp_path
    monkeypatch.setenv("PD_CACHE_DIR", "~/elsewhere")
    assert envs.PD_CACHE_DIR == Path.home() / "elsewhere"


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False)]
)
def test_debug_flag(monkeypatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("PD_DEBUG", raw)
    assert envs.PD_DEBUG is expected


def test_malformed_values_raise_with_name(monkeypatch) -> None:
    monkeypatch.setenv("PD_DEBUG", "maybe")
    with pytest.raises(ValueError, match="PD_DEBUG='maybe'"):
        _ = envs.PD_DEBUG
    monkeypatch.setenv("PD_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="PD_NUM_THREADS='two'"):
        _ = envs.PD_NUM_THREADS
    monkeypatch.setenv("PD_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="PD_NUM_THREADS=0 must be >= 1"):
        _ = envs.PD_NUM_THREADS


def test_num_threads(monkeypatch) -> None:
    monkeypatch.delenv("PD_NUM_THREADS", raising=False)
    assert envs.PD_NUM_THREADS is None
    monkeypatch.setenv("PD_NUM_THREADS", "3")
    assert envs.PD_NUM_THREADS == 3


def test_unknown_attribute() -> None:
    with pytest.raises(AttributeError, match="PD_NOPE"):
        _ = envs.PD_NOPE
