"""TensorBoard event files written (and read back) without tensorflow or tensorboard installed.

The format: records of ``uint64 length, uint32 masked-crc32c(length), data, uint32
masked-crc32c(data)``, each data an ``Event`` protocol buffer (wall_time, step, summary of
scalar values), the first one carrying ``file_version = "brain.Event:2"``. TensorBoard reads
these files like its own.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from typing import Dict, List, Tuple

__all__ = ["EventFileWriter", "read_scalars"]


def _crc32c_table() -> List[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint((number << 3) | 2) + _varint(len(payload)) + payload


def _event(step: int, wall_time: float, summary: bytes = b"", file_version: str = "") -> bytes:
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version:
        out += _field_bytes(3, file_version.encode())
    if summary:
        out += _field_bytes(5, summary)
    return out


def _scalar_summary(scalars: Dict[str, float]) -> bytes:
    values = b""
    for tag, value in scalars.items():
        body = _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value))
        values += _field_bytes(1, body)
    return values


class EventFileWriter:
    """Appends scalar summaries to ``<logdir>/events.out.tfevents.<time>.<host>``."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(logdir, name)
        self._f = open(self.path, "ab")
        self._write(_event(0, time.time(), file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data)))

    def add_scalars(self, scalars: Dict[str, float], step: int) -> None:
        self._write(_event(step, time.time(), _scalar_summary(scalars)))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


def _read_varint(buf: bytes, i: int) -> Tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i:i + n], i + n
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, value


def read_scalars(path: str) -> List[Tuple[int, str, float]]:
    """(step, tag, value) of every scalar in an event file; checks every CRC."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i:i + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[i + 8:i + 12])[0] != _masked(header):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        body = data[i + 12:i + 12 + length]
        if struct.unpack("<I", data[i + 12 + length:i + 16 + length])[0] != _masked(body):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + length
        step = 0
        for number, value in _fields(body):
            if number == 2:
                step = value
            elif number == 5:
                for _, v in _fields(value):
                    tag, scalar = "", None
                    for n, x in _fields(v):
                        if n == 1:
                            tag = x.decode()
                        elif n == 2:
                            (scalar,) = struct.unpack("<f", x)
                    if scalar is not None:
                        out.append((step, tag, scalar))
    return out
