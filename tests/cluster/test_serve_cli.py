"""The README's run command: `pd serve` starts the cluster and prints its URL once healthy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import free_port


@pytest.mark.timeout(300)
def test_pd_serve_prints_url_when_healthy_and_answers(smollm2_dir, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "pd.cli",
        "serve",
        "--port",
        str(port),
        "--max-total-tokens",
        "4096",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while f"pd is serving {url}/v1" not in log.read_text():
            assert proc.poll() is None, f"pd serve exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"no URL printed in 180 s: {log.read_text()[-3000:]}"
            )
            time.sleep(0.3)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        chat = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )
        assert chat.choices[0].message.content == "The capital of France is Paris."
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Ctrl-C is a normal way to stop the server: a clean exit, no traceback
    assert proc.returncode in (0, 130), (proc.returncode, log.read_text()[-3000:])
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
