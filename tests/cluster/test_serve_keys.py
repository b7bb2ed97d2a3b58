"""``pd serve``'s API keys from a file (``--api-key-file``) and the environment (``PD_API_KEY``),
which ``ps`` does not show, unlike ``--api-key``'s; the warning of a server open to the network
(a non-loopback ``--host``, no key); and the cache isolated per key (or key group) by default,
so ``cached_tokens`` tells no key what another sent. The colocated engine on a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.conftest import EXACT_EAGER, colocated_args, end_process_group, serve_colocated
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(120)

FILE_KEYS = ("tenant-from-file-0123456789", "tenant-from-file-9876543210")
ENV_KEY = "tenant-from-env-0123456789"
OPEN_WARNING = "is not a loopback address and no API key is set"
SHORT = {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}


def test_keys_from_a_file_and_the_environment_are_served_and_not_shown_by_ps(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("\n".join(FILE_KEYS) + "\n")
    key_file.chmod(0o600)
    env = {**os.environ, "PD_API_KEY": ENV_KEY}
    log = tmp_path / "serve.log"
    server = serve_colocated(tiny_llama_dir, log, "--api-key-file", str(key_file), env=env)
    try:
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ")
        assert b"--api-key-file" in cmdline
        assert not any(key.encode() in cmdline for key in (*FILE_KEYS, ENV_KEY)), cmdline
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for key in (*FILE_KEYS, ENV_KEY):
                r = http.post(
                    "/v1/completions", json=SHORT, headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 200, r.text
            for headers in ({"Authorization": "Bearer tenant-wrong-0123456789"}, {}):
                r = http.post("/v1/completions", json=SHORT, headers=headers)
                assert r.status_code == 401, r.text
                assert r.json()["error"]["code"] == "invalid_api_key"
    finally:
        server.end()
    text = log.read_text()
    assert OPEN_WARNING not in text and "chmod 600" not in text, server.tail()


def test_a_server_on_a_non_loopback_host_without_a_key_warns_at_start(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The warning comes before the engine is built; the server is ended once it is logged
    (it has not bound its port yet)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pd.cli", "serve", "--port", str(port), *EXACT_EAGER]
    cmd += [*colocated_args(tiny_llama_dir), "--host", "0.0.0.0"]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while OPEN_WARNING not in log.read_text():
            assert proc.poll() is None, f"pd serve exited: {log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no warning in 60 s: {log.read_text()[-4000:]}"
            time.sleep(0.1)
    finally:
        end_process_group(proc)
    line = next(s for s in log.read_text().splitlines() if OPEN_WARNING in s)
    assert "WARNING" in line and f"--host 0.0.0.0 {OPEN_WARNING}" in line, line
    assert f"whoever reaches port {port} may use the API" in line, line


GROUP_KEYS = ("tenant-a-0123456789", "tenant-b-0123456789", "tenant-c-0123456789")
GROUPED = "tenant-d-0123456789"
# ~150 tokens, the same text for every key
SECRET_PROMPT = "Internal memo for the finance team only: the quarterly numbers are " * 12


def _cached_tokens(http: httpx.Client, key: str) -> int:
    body = {"prompt": SECRET_PROMPT, "max_tokens": 1, "ignore_eos": True}
    r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_never_show_another_keys_prompt_but_a_groups_keys_share(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Keys A, B and C, then C and D in one group (``KEY GROUP`` lines): B sent after A the
    prompt A sent twice gets cached_tokens 0 (the oracle is closed by default); D gets the
    cache that C, of its group, filled."""
    a, b, c = GROUP_KEYS
    key_file = tmp_path / "keys"
    key_file.write_text(f"{a}\n{b}\n{c} team-cd\n{GROUPED} team-cd\n")
    key_file.chmod(0o600)
    server = serve_colocated(
        tiny_llama_dir, tmp_path / "serve.log", "--api-key-file", str(key_file)
    )
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert _cached_tokens(http, a) == 0
            hit = _cached_tokens(http, a)
            assert hit > 100, hit  # A's own prompt is cached for A
            assert _cached_tokens(http, b) == 0, "key B saw key A's cached prompt"
            assert _cached_tokens(http, c) == 0  # another tenant again
            assert _cached_tokens(http, GROUPED) == hit  # C's group shares C's cache
            assert _cached_tokens(http, b) == hit  # B's own, second time
    finally:
        server.end()
