"""Batched UDP receive with recvmmsg(2) through ctypes (Python's stdlib has no recvmmsg).

One system call fills up to ``batch`` slots of a preallocated ring, so the per-datagram
cost is the kernel copy and not a Python call plus a syscall each. Falls back to
``recv_into`` one datagram at a time where libc has no recvmmsg.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket

import numpy as np

MSG_DONTWAIT = 0x40


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(_IoVec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint)]


def _libc_recvmmsg():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.recvmmsg
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_MMsgHdr), ctypes.c_uint, ctypes.c_int,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_RECVMMSG = _libc_recvmmsg()


class BatchReceiver:
    """``recv()`` returns the lengths of the datagrams now in slots 0..k-1 of ``ring``."""

    def __init__(self, sock: socket.socket, batch: int = 64, slot: int = 9216) -> None:
        self.sock, self.batch, self.slot = sock, batch, slot
        self.ring = bytearray(batch * slot)
        self.view = memoryview(self.ring)
        self.native = _RECVMMSG is not None
        #: Lengths of the datagrams ``take`` returned, in slots 0..k-1.
        self.lens: np.ndarray = np.zeros(1, np.uint32)
        if not self.native:
            return
        base = ctypes.addressof((ctypes.c_char * len(self.ring)).from_buffer(self.ring))
        self._iov = (_IoVec * batch)()
        self._msgs = (_MMsgHdr * batch)()
        for i in range(batch):
            self._iov[i].iov_base = base + i * slot
            self._iov[i].iov_len = slot
            self._msgs[i].msg_hdr.msg_iov = ctypes.pointer(self._iov[i])
            self._msgs[i].msg_hdr.msg_iovlen = 1
        stride = ctypes.sizeof(_MMsgHdr) // 4
        off = _MMsgHdr.msg_len.offset // 4
        self._lens = np.frombuffer(self._msgs, dtype=np.uint32).reshape(batch, stride)[:, off]
        self.lens = self._lens
        self._fd = sock.fileno()

    def recv(self) -> list[int]:
        """Lengths of the datagrams received (at least one); BlockingIOError if none."""
        return self.lens[:self.take()].tolist()

    def take(self) -> int:
        """How many datagrams are now in slots 0..k-1 (their lengths in ``lens[:k]``, read
        in place from the mmsghdr array); BlockingIOError if none."""
        if not self.native:
            self.lens[0] = self.sock.recv_into(self.view[:self.slot])
            return 1
        n = _RECVMMSG(self._fd, self._msgs, self.batch, MSG_DONTWAIT, None)
        if n < 0:
            e = ctypes.get_errno()
            if e in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                raise BlockingIOError(e, os.strerror(e))
            raise OSError(e, os.strerror(e))
        return n
