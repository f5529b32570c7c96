"""Pinned BPF maps through the bpf(2) syscall, so map reads and writes need no subprocess.

Only the handful of commands the switch tables need: open a pinned map, lookup, update,
delete and iterate keys. Keys and values are raw bytes; :mod:`checkmate.dataplane.maps`
knows the layouts.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator

from checkmate.errors import CheckmateError

#: bpf(2)'s number per machine (the kernel's syscall tables: arch/x86/entry/syscalls/
#: syscall_64.tbl, and include/uapi/asm-generic/unistd.h for arm64 and riscv64).
_SYS_BPF_BY_ARCH = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "i686": 357, "i386": 357}
_MAP_LOOKUP_ELEM, _MAP_UPDATE_ELEM, _MAP_DELETE_ELEM, _MAP_GET_NEXT_KEY = 1, 2, 3, 4
_OBJ_GET, _OBJ_GET_INFO_BY_FD = 7, 15
BPF_ANY = 0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class BpfError(CheckmateError, OSError):
    """A bpf(2) call failed; carries errno."""


def _sys_bpf() -> int:
    machine = os.uname().machine
    if machine not in _SYS_BPF_BY_ARCH:
        raise CheckmateError(f"bpf(2): no syscall number known for machine {machine!r} "
                             f"(known: {', '.join(sorted(_SYS_BPF_BY_ARCH))})")
    return _SYS_BPF_BY_ARCH[machine]


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    ret = _libc.syscall(_sys_bpf(), ctypes.c_int(cmd), attr, ctypes.c_uint(len(attr)))
    if ret < 0:
        err = ctypes.get_errno()
        raise BpfError(err, f"bpf(cmd={cmd}): {os.strerror(err)}")
    return ret


def _attr() -> ctypes.Array:
    return ctypes.create_string_buffer(128)


def _put(attr: ctypes.Array, off: int, fmt_size: int, value: int) -> None:
    attr[off:off + fmt_size] = value.to_bytes(fmt_size, "little")


class PinnedMap:
    """A BPF map opened from its bpffs pin; closed with close() or as a context manager."""

    def __init__(self, path: str, key_size: int, value_size: int) -> None:
        attr = _attr()
        cpath = ctypes.create_string_buffer(os.fsencode(path))
        _put(attr, 0, 8, ctypes.addressof(cpath))
        try:
            self.fd = _bpf(_OBJ_GET, attr)
        except BpfError as e:
            raise BpfError(e.errno, f"cannot open pinned map {path}: {e.strerror}") from None
        self.path, self.key_size, self.value_size = path, key_size, value_size
        info = ctypes.create_string_buffer(80)
        a = _attr()
        _put(a, 0, 4, self.fd)
        _put(a, 4, 4, len(info))
        _put(a, 8, 8, ctypes.addressof(info))
        _bpf(_OBJ_GET_INFO_BY_FD, a)
        ks = int.from_bytes(info.raw[8:12], "little")
        vs = int.from_bytes(info.raw[12:16], "little")
        if (ks, vs) != (key_size, value_size):
            self.close()
            raise BpfError(errno.EINVAL, f"map {path} has key/value size {ks}/{vs}, "
                           f"expected {key_size}/{value_size} (stale object?)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _elem(self, cmd: int, key: bytes, value: ctypes.Array | None, flags: int = 0) -> int:
        if len(key) != self.key_size:
            raise ValueError(f"key must be {self.key_size} bytes")
        k = ctypes.create_string_buffer(key, self.key_size)
        attr = _attr()
        _put(attr, 0, 4, self.fd)
        _put(attr, 8, 8, ctypes.addressof(k))
        if value is not None:
            _put(attr, 16, 8, ctypes.addressof(value))
        _put(attr, 24, 8, flags)
        return _bpf(cmd, attr)

    def lookup(self, key: bytes) -> bytes | None:
        v = ctypes.create_string_buffer(self.value_size)
        try:
            self._elem(_MAP_LOOKUP_ELEM, key, v)
        except BpfError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return v.raw

    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
        if len(value) != self.value_size:
            raise ValueError(f"value must be {self.value_size} bytes")
        self._elem(_MAP_UPDATE_ELEM, key, ctypes.create_string_buffer(value, self.value_size),
                   flags)

    def delete(self, key: bytes) -> bool:
        """True if the key was there."""
        try:
            self._elem(_MAP_DELETE_ELEM, key, None)
        except BpfError as e:
            if e.errno == errno.ENOENT:
                return False
            raise
        return True

    def keys(self) -> Iterator[bytes]:
        nxt = ctypes.create_string_buffer(self.key_size)
        attr = _attr()
        _put(attr, 0, 4, self.fd)
        _put(attr, 8, 8, 0)  # NULL key: first key
        _put(attr, 16, 8, ctypes.addressof(nxt))
        cur = None
        while True:
            try:
                _bpf(_MAP_GET_NEXT_KEY, attr)
            except BpfError as e:
                if e.errno == errno.ENOENT:
                    return
                raise
            cur = ctypes.create_string_buffer(nxt.raw, self.key_size)
            yield cur.raw
            _put(attr, 8, 8, ctypes.addressof(cur))

    def items(self) -> list[tuple[bytes, bytes]]:
        out = []
        for k in list(self.keys()):
            v = self.lookup(k)
            if v is not None:
                out.append((k, v))
        return out
