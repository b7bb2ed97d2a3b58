"""Two-rank process groups over torch.distributed, one per (sender, receiver) pair.

No global world: each pair incarnation rendezvouses over its own ``PairStore``, whose keys
travel as sealed messages on the control plane (``rendezvous.py``), so a broken pair is simply
dropped and the next one is built under a new prefix, and no store port is open. The group's
own ``send``/``recv`` are used, because the ``torch.distributed.send/recv`` wrappers refuse
groups not registered in a world. Gloo moves CPU tensors, NCCL CUDA tensors (and needs the two
ranks on different GPUs).

Gloo's listener: each gloo pair has a device of its own, whose TCP listener takes the peer's
connection and stays open for the pair's life. Gloo keeps every other connection it accepts,
until the device goes: one that closes, or sends no sequence number, sits in ``CLOSE_WAIT``;
one that sends an unknown number waits in a map. So once the pair is connected, the listener
gets a socket filter that drops every packet (``SO_ATTACH_FILTER``): no stranger's connection
is accepted any more (a stranger's connect times out), and the pair's own, accepted before,
keeps no filter. The listener is the one listening socket the device's creation adds to the
process (``_new_gloo_device``, one device at a time; another is never filtered: with none or
two new, the pair goes on unfiltered, logged). While the pair rendezvouses (at most its connect
timeout) the listener takes anyone, as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from transfer.backend import BaseTransferBackend, PairError, Pending

log = logging.getLogger(__name__)

_PEER_TAG = 0
_DEVICE_LOCK = threading.Lock()  # one gloo device made at a time: its listener is the new one
_SO_ATTACH_FILTER = 26  # Linux, <asm-generic/socket.h>
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


class _SockFilter(ctypes.Structure):  # struct sock_filter
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _listening_sockets() -> dict[int, int]:
    """This process's listening TCP sockets: inode -> one of its descriptors."""
    fds: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(name)
    out: dict[int, int] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _TCP_LISTEN and (inode := int(cols[9])) in fds:
                out[inode] = fds[inode]
    return out


def _new_gloo_device(local_host: str) -> tuple[object, tuple[int, int] | None]:
    """A gloo device, and its listener (inode, descriptor) where it is the one listening
    socket its creation added to this process."""
    with _DEVICE_LOCK:
        try:
            before = _listening_sockets()
        except OSError:  # no /proc
            before = None
        # not lazy: the listener is made here, so one new listening socket is gloo's
        device = dist.ProcessGroupGloo.create_device(hostname=local_host, lazy_init=False)
        if before is None:
            return device, None
        new = [(inode, fd) for inode, fd in _listening_sockets().items() if inode not in before]
    return device, new[0] if len(new) == 1 else None


def _close_to_strangers(listener: tuple[int, int] | None, prefix: str) -> None:
    """Drops every packet that comes to ``listener`` from now on: no connection is accepted
    any more; the ones accepted before keep no filter."""
    if listener is not None:
        inode, fd = listener
        try:
            conn = socket.socket(fileno=os.dup(fd))  # owns the duplicate only
        except OSError:
            conn = None
        if conn is not None:
            with conn:
                if os.fstat(conn.fileno()).st_ino == inode:  # the same socket still
                    drop_all = (_SockFilter * 1)(_SockFilter(0x06, 0, 0, 0))  # BPF_RET|BPF_K 0
                    prog = _SockFprog(1, drop_all)
                    conn.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, bytes(prog))
                    return
    log.warning(
        "pair %s: gloo's listener not found: strangers' connections to it stay open for the "
        "pair's life",
        prefix,
    )


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
        store: dist.Store,
        prefix: str,
        rank: int,
        timeout_s: float,
        device: torch.device,
        local_host: str = "127.0.0.1",
    ) -> None:
        if kind not in ("gloo", "nccl"):
            raise ValueError(f"pair backend must be gloo or nccl, got {kind!r}")
        if kind == "nccl" and device.type != "cuda":
            raise ValueError(f"nccl pairs move CUDA tensors, got device {device}")
        if kind == "gloo" and device.type != "cpu":
            raise ValueError(f"gloo pairs move CPU tensors, got device {device}")
        assert rank in (0, 1), rank
        timeout = timedelta(seconds=timeout_s)
        self._store = store  # the group calls back into it: it must outlive the group
        self.kind, self.rank, self.device, self.prefix = kind, rank, device, prefix
        self._closed = False
        if kind == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            device, listener = _new_gloo_device(local_host)
            opts._devices = [device]
            self._pg: dist.ProcessGroup = dist.ProcessGroupGloo(store, rank, 2, opts)
            _close_to_strangers(listener, prefix)  # connected: the listener's work is done
        else:
            torch.cuda.set_device(device)
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = timeout
            # The NCCL communicator is created lazily by the first send/recv, on both ends.
            self._pg = dist.ProcessGroupNCCL(store, rank, 2, nccl_opts)

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
