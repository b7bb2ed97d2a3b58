"""The README's run command: `pd serve` starts the cluster and prints its URL once ready."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from tests.cluster.conftest import ServeProcess


@pytest.mark.timeout(300)
def test_pd_serve_prints_url_when_healthy_and_answers(smollm2_dir, tmp_path):
    server = ServeProcess(["--max-total-tokens", "4096"], tmp_path / "serve.log")
    try:
        url = server.url
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 200
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
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
        server.end(signal.SIGINT)
    # Ctrl-C is a normal way to stop the server: a clean exit, no traceback
    assert server.proc.returncode in (0, 130), (server.proc.returncode, server.tail())
    assert "Traceback" not in server.log.read_text(), server.tail()
