"""scripts/bench_launch.py: launch specs and the llama.cpp peer's command line."""

from __future__ import annotations

from pathlib import Path

import bench_launch
import bench_serving
import pytest


def test_llamacpp_command_serves_the_default_gguf_queued_and_overridable() -> None:
    from pd.model.loader import default_gguf_path

    launch = bench_launch.parse_launch("peer=--n_threads 1", "llamacpp")
    cmd = bench_launch.server_command(launch, 4321)
    assert cmd[:3] == [str(bench_launch.LLAMACPP_PYTHON), "-m", "llama_cpp.server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))  # later flags win, as in its argparse
    assert flags["--model"] == str(default_gguf_path())
    assert flags["--n_threads"] == "1"  # the launch's own args come last
    assert flags["--interrupt_requests"] == "False"  # queue concurrent requests, never cut them
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "4321")
    pd_cmd = bench_launch.server_command(bench_launch.parse_launch("c=--colocated"), 4321)
    assert pd_cmd[1:4] == ["-m", "pd.cli", "serve"] and pd_cmd[-1] == "--colocated"


def test_missing_side_venv_fails_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_launch, "LLAMACPP_PYTHON", tmp_path / "missing" / "python")
    started = []
    monkeypatch.setattr(bench_serving, "launched", lambda launch: started.append(launch))
    argv = ["--workload", "fixed", "--launch", "c=--colocated", "--launch-llamacpp", "peer"]
    assert bench_serving.main(argv) == 2
    assert started == []
    assert "run scripts/setup_llamacpp.sh" in capsys.readouterr().err


def test_launches_keep_command_line_order() -> None:
    args = bench_serving.parse_args(
        ["--launch-llamacpp", "peer", "--launch", "a=--colocated", "--launch-llamacpp", "x=-v"]
    )
    assert [(x.label, x.kind) for x in args.launch] == [
        ("peer", "llamacpp"),
        ("a", "pd"),
        ("x", "llamacpp"),
    ]
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--launch-llamacpp", "p=--port 1"])
