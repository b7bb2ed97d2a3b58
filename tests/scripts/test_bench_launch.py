"""pdtools/bench_launch.py: launch specs and the llama.cpp and vLLM peers' command lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdtools import bench_launch
from scripts import bench_serving


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


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
        + ["--launch-vllm", "vllm", "--launch", "pd-defaults="]
    )
    assert [(x.label, x.kind) for x in args.launch] == [
        ("peer", "llamacpp"),
        ("a", "pd"),
        ("x", "llamacpp"),
        ("vllm", "vllm"),
        ("pd-defaults", "pd"),
    ]
    assert args.launch[-1].args == []
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--launch-llamacpp", "p=--port 1"])


def test_vllm_command_serves_pds_converted_default_model_at_vllms_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import pd.model.loader

    resolved: list[object] = []
    monkeypatch.setattr(  # the converted checkpoint's path, without converting it here
        pd.model.loader, "resolve_model", lambda model: resolved.append(model) or tmp_path
    )
    launch = bench_launch.parse_launch("vllm=--max-num-seqs 8", "vllm")
    assert launch == bench_launch.Launch("vllm", ["--max-num-seqs", "8"], "vllm")
    cmd = bench_launch.server_command(launch, 4321)
    assert resolved == [None]  # pd's default model, as `pd serve` resolves it
    assert cmd[:3] == [str(bench_launch.VLLM_BIN), "serve", str(tmp_path)]
    assert cmd[-2:] == ["--max-num-seqs", "8"]  # the launch's own args come last
    assert _flag(cmd, "--served-model-name") == "SmolLM2-135M-Instruct"  # pd's model id
    assert (_flag(cmd, "--host"), _flag(cmd, "--port")) == ("127.0.0.1", "4321")
    assert "--enable-prompt-tokens-details" in cmd  # cached_tokens in usage: the hit rate
    # its defaults stand: nothing chooses dtype, caching or compilation for it
    assert not {"--dtype", "-O0", "--no-enable-prefix-caching", "--enforce-eager"} & set(cmd)
    with pytest.raises(ValueError, match="--port is set by the launcher"):
        bench_launch.parse_launch("v=--port=1", "vllm")


def test_vllm_threads_and_kv_cache_pinned_unless_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm, pd_launch = bench_launch.parse_launch("v", "vllm"), bench_launch.parse_launch("p")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(bench_launch.os, "sched_getaffinity", lambda pid: {3, 2, 5})
    pins = {"VLLM_CPU_OMP_THREADS_BIND": "2", "VLLM_CPU_KVCACHE_SPACE": "4"}
    assert bench_launch.pinned_env(vllm) == pins  # one OpenMP thread, on the first core
    assert bench_launch.pinned_env(pd_launch) == {}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert bench_launch.pinned_env(vllm) == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_missing_vllm_venv_names_its_setup_script(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_launch, "VLLM_BIN", tmp_path / "missing" / "vllm")
    with pytest.raises(RuntimeError, match=r"\[peer\] no vllm server at .*run scripts/setup_vllm"):
        bench_launch.check_launchable(bench_launch.parse_launch("peer", "vllm"))
    started = []
    monkeypatch.setattr(bench_serving, "launched", lambda launch: started.append(launch))
    argv = ["--workload", "fixed", "--launch", "pd-defaults=", "--launch-vllm", "vllm"]
    assert bench_serving.main(argv) == 2
    assert started == []
    assert "run scripts/setup_vllm.sh" in capsys.readouterr().err
