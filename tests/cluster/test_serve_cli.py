"""The README's run command: `pd serve` starts the cluster and prints its URL once ready."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from tests.cluster.conftest import ServeProcess


def test_pd_serve_defaults_to_int4_and_compiled_steps_on_a_cpu_and_generate_to_fp32() -> None:
    from pd.cli import build_parser, engine_config

    serve = engine_config(build_parser().parse_args(["serve"]))
    smollm2 = (576, 576, 1536)  # the in_features of its linears
    assert (serve.quantization_method(smollm2), serve.buckets) == ("int4", (1, 2, 4))
    assert serve.quantization_method((576, 100)) == "none"  # 100 inputs: no int4 groups of 32
    bf16 = engine_config(build_parser().parse_args(["serve", "--dtype", "bfloat16"]))
    assert bf16.quantization_method(smollm2) == "none"  # a chosen precision is kept
    gen = engine_config(build_parser().parse_args(["generate", "--prompt", "hi"]))
    assert (gen.quantization_method(smollm2), gen.buckets) == ("none", ())
    with pytest.raises(ValueError, match="compile buckets"):
        engine_config(build_parser().parse_args(["serve", "--compile-buckets", "auto,2"]))


def test_pd_serve_has_no_prefill_pool_on_this_cpu_unless_asked_or_on_a_cluster() -> None:
    from pd.cli import build_parser
    from pd.cli.serve import prefill_pool_size
    from pd.fleet.config import ClusterConfig

    def size(*flags: str) -> int:
        return prefill_pool_size(build_parser().parse_args(["serve", *flags]))

    assert size() == 0  # the nodes would share this machine's cores
    assert size("--prefill", "2") == 2 and size("--prefill", "0", "--address", "auto") == 0
    assert size("--address", "auto") == size("--node-gpus", "1") == size("--autoscale") == 1
    assert ClusterConfig(num_prefill=0).num_prefill == 0
    for prefill, decode in ((-1, 1), (1, 0)):
        with pytest.raises(ValueError, match=f"got {prefill} and {decode}"):
            ClusterConfig(num_prefill=prefill, num_decode=decode)


@pytest.mark.timeout(300)
def test_pd_serve_prints_url_when_healthy_and_answers(smollm2_dir, tmp_path):
    # pd serve's defaults but the compiled steps (each would add ~40 s here; graphs are
    # tested in tests/executor/test_graphs.py): int4 weights, 1 decode node that prefills
    server = ServeProcess(
        ["--max-total-tokens", "4096", "--compile-buckets", "off"],
        tmp_path / "serve.log",
        serve_defaults=True,
    )
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
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert "\npd_local_prefills 1.0" in metrics, metrics  # no prefill node: local
        assert "starting 1 decode node(s), which prefill too" in server.log.read_text()
    finally:
        server.end(signal.SIGINT)
    # Ctrl-C is a normal way to stop the server: a clean exit, no traceback
    assert server.proc.returncode in (0, 130), (server.proc.returncode, server.tail())
    assert "Traceback" not in server.log.read_text(), server.tail()
