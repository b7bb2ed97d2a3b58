"""A disk-tier chunk file's format: its key, its bytes, and the checks a read makes
(``pd.cache.disk_tier`` holds the chunks; this module never touches the directory).

File layout::

    b"PDKV2\n" | header length n (4 bytes, little endian) | header (msgpack, n bytes)
              | tag (32 bytes) | payload
    tag = HMAC-SHA256(the directory's key, the bytes before it)

The header (``ChunkHeaderMsg``) repeats the key's parts and holds the payload's sha256. A read
checks, in order: the magic, ``n <= MAX_HEADER_BYTES``, the tag (so a file written without the
key is never parsed), the header's shape (a typed msgspec decode: no recursion, no unknown
fields), its key, namespace and token path (``ChunkHeaderMsg.names``), the payload's length
and sha256 (``read_payload``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import IO

import msgspec

MAGIC = b"PDKV2\n"
_PREFIX = len(MAGIC) + 4  # the magic and the header's length
_TAG_BYTES = 32
MAX_HEADER_BYTES = 1 << 20  # a token path of ~200k tokens; a longer header is rejected unread

Tag = Callable[[bytes], bytes]  # the directory's HMAC of the bytes before the tag


class ChunkHeaderMsg(msgspec.Struct, forbid_unknown_fields=True):
    """What a chunk file says it is (authenticated by its tag)."""

    model_key: str
    namespace: str
    tokens: list[int]  # the path from its root to the chunk's end
    payload_bytes: int
    payload_sha256: bytes

    def names(self, key: str, namespace: str, path: Sequence[int]) -> bool:
        """The header names exactly this key, namespace and token path."""
        return self.model_key == key and self.namespace == namespace and self.tokens == list(path)


_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(ChunkHeaderMsg).decode


def model_key(*parts: object) -> str:
    """A short digest of what a chunk's KV depends on besides its tokens (model files, weight
    format, KV dtype, page size, chunk size)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def chain_key(key: str, namespace: str, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(f"{key}|{namespace}|".encode())
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return h.hexdigest()[:40]


def chain_keys(
    key: str, namespace: str, tokens: Sequence[int], first: int, step: int
) -> Iterator[tuple[int, str]]:
    """(end, ``chain_key`` of ``tokens[:end]``) for end = first, first + step, ... (within
    ``tokens``), hashing each token once (a 4k-token match: 64 keys, not 64 prefixes)."""
    h = hashlib.sha256(f"{key}|{namespace}|".encode())
    done = 0
    for end in range(first, len(tokens) + 1, step):
        h.update(struct.pack(f"<{end - done}i", *tokens[done:end]))
        done = end
        yield end, h.copy().hexdigest()[:40]


def chunk_bytes(key: str, namespace: str, path: list[int], payload: bytes, tag: Tag) -> bytes:
    """The whole file of the chunk of ``path``'s last tokens holding ``payload``."""
    header = _encode_header(
        ChunkHeaderMsg(key, namespace, path, len(payload), hashlib.sha256(payload).digest())
    )
    signed = MAGIC + struct.pack("<I", len(header)) + header
    return signed + tag(signed) + payload


def read_header(f: IO[bytes], size: int, tag: Tag) -> ChunkHeaderMsg | None:
    """The authenticated header of the chunk file ``f`` of ``size`` bytes (read up to the
    payload), or None if any check fails."""
    head = f.read(_PREFIX)
    if len(head) < _PREFIX or not head.startswith(MAGIC):
        return None
    (n,) = struct.unpack_from("<I", head, len(MAGIC))
    if n > MAX_HEADER_BYTES or _PREFIX + n + _TAG_BYTES > size:
        return None
    body = f.read(n + _TAG_BYTES)
    if len(body) != n + _TAG_BYTES:
        return None
    if not hmac.compare_digest(tag(head + body[:n]), body[n:]):
        return None  # not written under this directory's key: never parsed
    try:
        header = _decode_header(body[:n])
    except msgspec.DecodeError:
        return None
    if header.payload_bytes != size - _PREFIX - n - _TAG_BYTES:
        return None
    return header


def read_payload(f: IO[bytes], header: ChunkHeaderMsg) -> bytearray | None:
    """The payload after ``header`` (``f`` read up to it), or None if it is short or its sha256
    is not the header's."""
    data = bytearray(header.payload_bytes)  # one writable buffer: a view of it
    if f.readinto(data) != len(data) or hashlib.sha256(data).digest() != header.payload_sha256:
        return None
    return data
