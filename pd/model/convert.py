"""A GGUF file converted once into an HF checkpoint directory (``pd.model.loader`` finds
models and picks the directory): dequantized to fp32 by transformers' GGUF loader, Q/K permuted
back to HF layout, and checked to load back bit-equal before it is renamed into place.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

# Written last into a conversion's temp dir: a cache dir holding it is complete.
_MARKER_FILE = "pd_conversion.json"


class ModelLoadError(RuntimeError):
    """A model exists but cannot be used: bad layout, corrupt files, failed conversion."""


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert ``gguf_path`` into the HF checkpoint dir ``out_dir`` unless already done.

    The work happens in a temp dir next to ``out_dir`` that is renamed into place only after
    the result loads back identically, so ``out_dir`` is either absent or complete. A file
    lock keeps concurrent processes from converting the same model twice.
    """
    if _is_converted(out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _is_converted(out_dir):  # another process finished while we waited
            return out_dir
        if out_dir.exists():
            raise ModelLoadError(
                f"{out_dir} exists but is not a complete pd conversion (no {_MARKER_FILE}); "
                "delete it to convert again"
            )
        for stale in out_dir.parent.glob(f".tmp-{out_dir.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a crashed conversion
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
        try:
            start = time.perf_counter()
            logger.info("converting %s into %s", gguf_path, out_dir)
            _write_converted(gguf_path, tmp_dir)
            seconds = time.perf_counter() - start
            _write_marker(gguf_path, tmp_dir, seconds)
            _make_readable(tmp_dir)
            os.rename(tmp_dir, out_dir)
            logger.info("converted %s in %.1f s", gguf_path.name, seconds)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return out_dir


def _is_converted(out_dir: Path) -> bool:
    return (out_dir / _MARKER_FILE).is_file()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_converted(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"transformers cannot load GGUF {gguf_path}: {e}") from e

    # transformers refuses save_pretrained on a GGUF-loaded model, so write the pieces.
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if _is_tied(model, state):
        # safetensors refuses aliased tensors; the config's tie flag restores lm_head.
        del state["lm_head.weight"]
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = model.config.to_diff_dict()  # what save_pretrained would write
    config.pop("quantization_config", None)  # else from_pretrained would look for a GGUF
    config.pop("_name_or_path", None)
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))

    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(gguf_path)
    tokenizer.save_pretrained(str(out_dir))
    _verify_converted(out_dir, model, tokenizer)


def _is_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    return (
        bool(getattr(model.config, "tie_word_embeddings", False))
        and head is not None
        and embed is not None
        and head.data_ptr() == embed.data_ptr()
    )


def _gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).get_field("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _verify_converted(out_dir: Path, source: torch.nn.Module, source_tokenizer: Any) -> None:
    """Load ``out_dir`` the way HF-reference tests will and require bit-equal weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(
        str(out_dir), dtype=torch.float32, local_files_only=True
    )
    expected, actual = source.state_dict(), reloaded.state_dict()
    if set(expected) != set(actual):
        diff = sorted(set(expected) ^ set(actual))
        raise ModelLoadError(f"converted {out_dir} has different tensor names, e.g. {diff[:3]}")
    for name, tensor in expected.items():
        if not torch.equal(tensor, actual[name]):
            raise ModelLoadError(f"converted tensor {name!r} differs from the GGUF-loaded one")

    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    sample = "Hello, world! The capital of France is Paris. 12345 <|im_end|>"
    if tokenizer.encode(sample) != source_tokenizer.encode(sample):
        raise ModelLoadError(f"converted tokenizer in {out_dir} encodes differently")
    if not tokenizer.chat_template:
        logger.warning("%s has no chat template; chat requests will be refused", out_dir)


def _make_readable(out_dir: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; the cache is meant to be shared.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def _write_marker(gguf_path: Path, out_dir: Path, seconds: float) -> None:
    import transformers

    marker = {
        "source": str(gguf_path.resolve()),
        "source_bytes": gguf_path.stat().st_size,
        "transformers_version": transformers.__version__,
        "convert_seconds": round(seconds, 2),
        "created_unix": int(time.time()),
    }
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
