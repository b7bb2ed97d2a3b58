"""scripts/bench_chat_engine.py: the chat load replayed in-process, each step timed by kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.bench_chat_engine import main


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_configs_replay_the_load_and_count_their_steps(tiny_llama_dir: Path, capsys) -> None:
    model = f"--model {tiny_llama_dir} --max-total-tokens 2048 --quantization none --compile-buckets off"
    argv = [
        "--num-groups", "2", "--prompts-per-group", "2", "--prefix-len", "300",
        "--max-tokens", "3", "--max-concurrency", "2",
        "--config", f"fp32={model}", "--config", f"bf16={model} --dtype bfloat16",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| fp32", "| bf16"]
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        hit_rate = float(cells[5].rstrip("%"))
        assert hit_rate > 0, row  # each group's second question found its system prompt
        # 4 requests x 3 tokens: at least one cold prefill, and decode steps for the rest
        steps = {kind: int(cells[6 + 2 * i].split("(")[1].rstrip(")")) for i, kind in
                 enumerate(("prefill", "mixed", "decode", "compiled"))}  # fmt: skip
        assert steps["prefill"] >= 1 and steps["decode"] >= 2 and steps["compiled"] == 0, row


def test_a_config_without_a_label_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--config", "bf16 --dtype bfloat16"])  # no "label="
