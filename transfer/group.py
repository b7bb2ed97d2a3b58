"""Two-rank process groups over torch.distributed, one per (sender, receiver) pair.

No global world: rank 0 (the sender) hosts one ``TCPStore`` for all its pairs, and each pair
incarnation lives under its own ``PrefixStore`` prefix, so a broken pair is simply dropped and
the next one is built under a new prefix. The group's own ``send``/``recv`` are used, because
the ``torch.distributed.send/recv`` wrappers refuse groups not registered in a world.
Gloo moves CPU tensors, NCCL CUDA tensors (and needs the two ranks on different GPUs).

The store takes any client, so before a group is built the two ranks prove to each other
that they hold the cluster secret, under the incarnation's prefix:

    1. each rank writes a fresh nonce (``auth/nonce{rank}``) and reads the other's
    2. each writes ``auth/proof{rank}`` = HMAC(secret, prefix, rank, nonce0, nonce1) and checks
       the other's: a mismatch (a stranger, another cluster, a key overwritten) is a
       ``PairError`` for this pair alone, within the connect timeout
    3. the group itself lives under a prefix derived from the secret and both nonces, which a
       stranger reading the store cannot compute, so it cannot pose as a rank in the group's
       own rendezvous either
"""

from __future__ import annotations

import hmac
import secrets
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from transfer.auth import check_secret
from transfer.backend import BaseTransferBackend, PairError, Pending

_PEER_TAG = 0


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A store on a free port of ``host`` (that interface only: TCPStore alone would listen on
    all of them), shared by every pair this node is rank 0 of."""
    listener = socket.create_server((host, 0), backlog=128)
    port = listener.getsockname()[1]
    timeout = timedelta(seconds=timeout_s)
    fd = listener.detach()  # the store owns the socket from here on
    return dist.TCPStore(
        host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd
    )


def _proof_mac(secret: bytes, what: bytes, prefix: str, nonces: tuple[bytes, bytes]) -> bytes:
    return hmac.digest(secret, b"|".join((b"pd-pair", what, prefix.encode(), *nonces)), "sha256")


def prove_pair(store: dist.Store, secret: bytes, rank: int, prefix: str) -> str:
    """Steps 1-2 above on ``store`` (already under ``prefix``); the group's own prefix (step
    3). Blocks until the peer answers or the store's timeout; ``PairError`` if it fails."""
    mine = secrets.token_bytes(16)
    store.set(f"auth/nonce{rank}", mine)
    try:
        theirs = store.get(f"auth/nonce{1 - rank}")
        nonces = (mine, theirs) if rank == 0 else (theirs, mine)
        store.set(f"auth/proof{rank}", _proof_mac(secret, b"%d" % rank, prefix, nonces))
        proof = store.get(f"auth/proof{1 - rank}")
    except RuntimeError as e:  # the store's timeout, or it went away
        raise PairError(f"pair {prefix}: no proof from rank {1 - rank}: {e}") from None
    if not hmac.compare_digest(proof, _proof_mac(secret, b"%d" % (1 - rank), prefix, nonces)):
        raise PairError(f"pair {prefix}: rank {1 - rank} failed the proof of the cluster secret")
    return _proof_mac(secret, b"group", prefix, nonces)[:16].hex()


class _TorchPending(Pending):
    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self, timeout_s: float) -> None:
        # Gloo raises on timeout (and closes the pair). NCCL blocks the CPU until done or
        # timed out and makes the current stream wait on the op, so kernels that read the
        # buffer afterwards on that stream see the data.
        ok = self._work.wait(timedelta(seconds=max(timeout_s, 0.001)))
        if ok is False:
            raise PairError(f"pair op did not complete within {timeout_s:.3f} s")


class TorchPairGroup(BaseTransferBackend):
    """One end of a gloo or NCCL pair. The constructor blocks until the peer joins (or
    ``timeout_s`` passes), so build it on a worker thread, never on a node's event loop."""

    def __init__(
        self,
        kind: str,
        *,
        store_host: str,
        store_port: int,
        prefix: str,
        rank: int,
        timeout_s: float,
        device: torch.device,
        secret: bytes,
        local_host: str = "127.0.0.1",
        store: dist.TCPStore | None = None,
    ) -> None:
        if kind not in ("gloo", "nccl"):
            raise ValueError(f"pair backend must be gloo or nccl, got {kind!r}")
        if kind == "nccl" and device.type != "cuda":
            raise ValueError(f"nccl pairs move CUDA tensors, got device {device}")
        if kind == "gloo" and device.type != "cpu":
            raise ValueError(f"gloo pairs move CPU tensors, got device {device}")
        assert rank in (0, 1), rank
        check_secret(secret)
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(store_host, store_port, None, False, timeout)
        self._store = store  # rank 1 owns its client connection; rank 0 shares the host's
        incarnation = dist.PrefixStore(prefix, store)
        prefixed = dist.PrefixStore(prove_pair(incarnation, secret, rank, prefix), incarnation)
        self.kind, self.rank, self.device, self.prefix = kind, rank, device, prefix
        self._closed = False
        if kind == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            self._pg: dist.ProcessGroup = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
        else:
            torch.cuda.set_device(device)
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            # The NCCL communicator is created lazily by the first send/recv, on both ends.
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)

    def isend(self, tensor: torch.Tensor) -> Pending:
        if self._closed:
            raise PairError(f"pair {self.prefix} is closed")
        return _TorchPending(self._pg.send([tensor], 1 - self.rank, _PEER_TAG))

    def irecv(self, tensor: torch.Tensor) -> Pending:
        if self._closed:
            raise PairError(f"pair {self.prefix} is closed")
        return _TorchPending(self._pg.recv([tensor], 1 - self.rank, _PEER_TAG))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # NCCL: abort() frees communicators without waiting for in-flight kernels.
            # Gloo: abort() closes the pair's sockets so a blocked peer errors out at once.
            self._pg.abort()
        except RuntimeError:
            pass
        del self._pg
