"""A seeded, deterministic mutator of checkpoint files.

``mutation(seed_files, index, campaign=...)`` picks one file of a seed and one way to damage
it, from a ``random.Random`` seeded by the campaign and the mutant's index, so that mutant
``i`` is the same bytes on every machine and every run (``python -m tests.fuzz --only i``
rebuilds it). Levels, as in the issue that asked for the campaign: bytes (flips, truncation,
insertion), pickle opcodes (replaced, inserted, huge lengths, deep nesting, forbidden globals
that would write a marker file), structure (valid pickles and headers that lie: shapes,
offsets, counts), safetensors header JSON, index JSON, zip records (sizes, names, CRCs).

Hand-made bytes here are hostile inputs only: every seed comes from a real writer
(:mod:`tests.fuzz.seeds`).
"""

from __future__ import annotations

import io
import json
import pickle
import pickletools
import random
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCAL = struct.Struct("<4sHHHHHIIIHH")
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
EOCD = struct.Struct("<4sHHHHIIH")
HUGE = (2**31 - 1, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**64 + 7, -1, -(2**40))

# Calls a hostile pickle makes; each would create the marker file if it ever ran.
TRAPS: tuple[tuple[str, str, str], ...] = (
    ("posix", "system", "touch {marker}"),
    ("os", "system", "touch {marker}"),
    ("builtins", "eval", "open({marker!r}, 'w')"),
    ("builtins", "exec", "open({marker!r}, 'w')"),
    ("builtins", "open", "{marker}"),
    ("io", "open", "{marker}"),
    ("subprocess", "getoutput", "touch {marker}"),
    ("pathlib", "Path", "{marker}"),
    ("torch.serialization", "load", "{marker}"),
    ("numpy.core.multiarray", "_reconstruct", "{marker}"),
    ("__builtin__", "eval", "open({marker!r}, 'w')"),
    ("torch._utils", "_rebuild_tensor_v2", "{marker}"),
)
DANGEROUS_GLOBALS = tuple((m, n) for m, n, _ in TRAPS) + (
    ("builtins", "getattr"), ("builtins", "__import__"), ("shutil", "rmtree"),
    ("webbrowser", "open"), ("runpy", "run_path"), ("pickle", "loads"),
)


@dataclass(frozen=True)
class Mutant:
    """One damaged copy of a seed: which file, how, and what must hold of it."""

    index: int
    seed: str
    file: str  # relative to the seed's copied root
    op: str
    detail: str
    data: bytes | None  # the file's new bytes; None: the file is removed
    crc_protected: bool = False  # a stored CRC-32 covers the changed bytes, unfixed

    def describe(self) -> str:
        return f"#{self.index} {self.seed} {self.file}: {self.op} {self.detail}"


# --------------------------------------------------------------------------------------------
# File kinds


def kind_of(name: str, data: bytes) -> str:
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".metadata"):
        return "pickle"
    if data[:4] == b"PK\x03\x04":
        return "zip"
    if base.endswith(".distcp"):
        return "records"  # DCP records that are not a single zip (zstd, safetensors blobs)
    if base.endswith(".safetensors") or _safetensors_header(data) is not None:
        return "safetensors"
    if base.endswith(".json"):
        return "json"
    if base.endswith(".py"):
        return "skip"
    return "text"


def _safetensors_header(data: bytes) -> dict[str, Any] | None:
    if len(data) < 10:
        return None
    (n,) = struct.unpack_from("<Q", data)
    if n > len(data) - 8 or data[8:9] != b"{":
        return None
    try:
        header = json.loads(data[8:8 + n])
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


# --------------------------------------------------------------------------------------------
# Byte level


def flip(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> tuple[bytes, str]:
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data + b"\x00", "append one byte (empty range)"
    buf = bytearray(data)
    at = rng.randrange(lo, hi)
    bit = 1 << rng.randrange(8)
    buf[at] ^= bit
    return bytes(buf), f"flip bit {bit:#x} at byte {at}"


def _bytes_op(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    n = len(data)
    op = rng.choice(("flip", "flips", "truncate", "truncate", "insert", "zero", "dup", "empty",
                     "ff"))
    if op == "flip" or n == 0:
        return flip(rng, data)
    if op == "flips":
        buf = bytearray(data)
        k = rng.randint(2, 16)
        for _ in range(k):
            buf[rng.randrange(n)] = rng.randrange(256)
        return bytes(buf), f"{k} random bytes"
    if op == "truncate":
        at = rng.choice((rng.randrange(n), n - 1, n // 2, 8, 1))
        return data[:at], f"truncated to {at} bytes"
    if op == "insert":
        at = rng.randrange(n + 1)
        k = rng.choice((1, 3, 8, 64, 1000))
        return data[:at] + rng.randbytes(k) + data[at:], f"{k} random bytes inserted at {at}"
    if op == "zero":
        at = rng.randrange(n)
        k = rng.choice((4, 16, 256, n))
        return data[:at] + bytes(min(k, n - at)) + data[at + k:], f"{k} bytes zeroed at {at}"
    if op == "dup":
        at = rng.randrange(n)
        k = rng.choice((16, 256, 4096))
        return data[:at] + data[at:at + k] * 2 + data[at + k:], f"{k} bytes doubled at {at}"
    if op == "ff":
        at = rng.randrange(n)
        return data[:at] + b"\xff" * 8 + data[at + 8:], f"8 bytes of 0xff at {at}"
    return b"", "emptied"


# --------------------------------------------------------------------------------------------
# Pickle opcodes

_OPCODES = [op.code.encode("latin-1") for op in pickletools.opcodes]


def _ops(data: bytes) -> list[tuple[Any, Any, int]]:
    try:
        return [(op, arg, pos) for op, arg, pos in pickletools.genops(data)]
    except Exception:  # noqa: BLE001 - a damaged pickle: the opcodes read so far
        out: list[tuple[Any, Any, int]] = []
        try:
            for item in pickletools.genops(data):
                out.append((item[0], item[1], item[2] or 0))
        except Exception:  # noqa: BLE001
            pass
        return out


def _trap_call(module: str, name: str, arg: str) -> bytes:
    """Opcodes that call ``module.name(arg)`` and drop the result (protocol 0-2 safe)."""
    text = arg.encode()
    return (b"c" + module.encode() + b"\n" + name.encode() + b"\n" + b"(X"
            + struct.pack("<I", len(text)) + text + b"tR0")


def pickle_op(rng: random.Random, data: bytes, marker: str) -> tuple[bytes, str]:
    """Damage a pickle stream at the opcode level."""
    ops = _ops(data)
    if not ops:
        return _bytes_op(rng, data)
    op = rng.choice(("replace", "insert", "length", "int", "nest", "global", "trap", "trap",
                     "memo", "stop"))
    body = 2 if data[:1] == b"\x80" else 0  # after PROTO
    if op == "replace":
        _, _, pos = rng.choice(ops)
        new = rng.choice(_OPCODES)
        return data[:pos] + new + data[pos + 1:], f"opcode at {pos} replaced by {new!r}"
    if op == "insert":
        _, _, pos = rng.choice(ops)
        new = rng.choice(_OPCODES) * rng.choice((1, 2, 100))
        return data[:pos] + new + data[pos:], f"opcodes {new[:4]!r}.. inserted at {pos}"
    if op == "length":
        sized = [(o, a, p) for o, a, p in ops if o.name in (
            "BINUNICODE", "BINBYTES", "SHORT_BINUNICODE", "SHORT_BINBYTES", "BINUNICODE8",
            "BINBYTES8", "LONG_BINPUT", "LONG_BINGET", "BINPUT", "BINGET", "LONG1", "FRAME")]
        if sized:
            o, _, pos = rng.choice(sized)
            width = {"SHORT_BINUNICODE": 1, "SHORT_BINBYTES": 1, "BINPUT": 1, "BINGET": 1,
                     "LONG1": 1, "BINUNICODE8": 8, "BINBYTES8": 8, "FRAME": 8}.get(o.name, 4)
            value = (1 << (8 * width)) - rng.choice((1, 2, 16))
            new = value.to_bytes(width, "little")
            return (data[:pos + 1] + new + data[pos + 1 + width:],
                    f"{o.name} at {pos}: length/index {value}")
    if op == "int":
        ints = [(o, a, p) for o, a, p in ops if o.name in ("BININT", "BININT1", "BININT2",
                                                             "LONG1")]
        if ints:
            o, _, pos = rng.choice(ints)
            value = rng.choice(HUGE)
            enc = pickle.dumps(value, protocol=2)[2:-1]  # BININT/LONG1 opcode + argument
            width = {"BININT": 4, "BININT1": 1, "BININT2": 2}.get(o.name)
            end = pos + 1 + (width if width is not None else 1 + data[pos + 1])
            return data[:pos] + enc + data[end:], f"{o.name} at {pos} -> {value}"
    if op == "nest":
        depth = rng.choice((1000, 100_000, 1_000_000))
        kind = rng.choice(("list", "tuple", "dict"))
        if kind == "list":
            nest = b"]" * depth + b"a" * (depth - 1)
        elif kind == "tuple":
            nest = b")" + b"\x85" * depth  # TUPLE1 around the previous
        else:
            nest = b"}" + b"K\x01}" * depth + b"s" * depth
        where = rng.choice(("whole", "prefix"))
        if where == "whole":
            return data[:body] + nest + b".", f"replaced by a {kind} nested {depth} deep"
        return data[:body] + nest + b"0" + data[body:], f"{kind} nested {depth} deep in front"
    if op == "global":
        globs = [(o, a, p) for o, a, p in ops if o.name in ("GLOBAL", "STACK_GLOBAL")]
        module, name = rng.choice(DANGEROUS_GLOBALS)
        if globs:
            o, a, pos = rng.choice(globs)
            if o.name == "GLOBAL":
                end = data.index(b"\n", data.index(b"\n", pos) + 1) + 1
                return (data[:pos] + f"c{module}\n{name}\n".encode() + data[end:],
                        f"GLOBAL {a} -> {module} {name}")
            # STACK_GLOBAL: push our own strings and use them instead of the two before
            new = (b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c"
                   + bytes([len(name)]) + name.encode() + b"\x93")
            return (data[:pos] + b"00" + new + data[pos + 1:],
                    f"STACK_GLOBAL at {pos} -> {module} {name}")
    if op == "trap":
        module, name, arg = rng.choice(TRAPS)
        call = _trap_call(module, name, arg.format(marker=marker))
        _, _, pos = rng.choice(ops[:-1] or ops)
        pos = rng.choice((body, pos))
        return data[:pos] + call + data[pos:], f"call {module}.{name} inserted at {pos}"
    if op == "memo":
        return (data[:body] + b"h\xff" * 4 + data[body:], "BINGET of an unset memo slot")
    # "stop": an early STOP or none at all
    cut = rng.choice(ops)[2]
    return data[:cut] + b".", f"STOP at {cut}"


# --------------------------------------------------------------------------------------------
# Zip records (torch.save): every local header, with where its data lies


@dataclass(frozen=True)
class Entry:
    header: int
    name: str
    data: int
    size: int


def zip_locals(data: bytes) -> list[Entry]:
    """Every entry of every zip record in ``data`` (torch.save archives back to back, as DCP
    writes them), from the central directories: torch leaves sizes out of local headers."""
    out: list[Entry] = []
    for m in re.finditer(b"PK\x05\x06", data):
        end = m.start()
        if end + EOCD.size > len(data):
            continue
        _, _, _, _, count, cd_size, cd_offset, _ = EOCD.unpack_from(data, end)
        cd_end = end
        if data[end - 20:end - 16] == b"PK\x06\x07":  # zip64 locator: its end record first
            (z64,) = struct.unpack_from("<Q", data, end - 12)
            cd_end = data.rfind(b"PK\x06\x06", 0, end - 20)
            if cd_end >= 0 and (count == 0xFFFF or cd_offset == 0xFFFFFFFF
                                or cd_size == 0xFFFFFFFF):
                count, cd_size, cd_offset = struct.unpack_from("<QQQ", data, cd_end + 32)
        record = cd_end - cd_size - cd_offset
        if record < 0:
            continue
        p = record + cd_offset
        for _ in range(count):
            if p + CENTRAL.size > len(data) or data[p:p + 4] != b"PK\x01\x02":
                break
            fields = CENTRAL.unpack_from(data, p)
            csize, nlen, xlen, clen, local = fields[8], fields[10], fields[11], fields[12], \
                fields[16]
            name = data[p + CENTRAL.size:p + CENTRAL.size + nlen].decode("utf-8", "replace")
            extra = data[p + CENTRAL.size + nlen:p + CENTRAL.size + nlen + xlen]
            if csize == 0xFFFFFFFF or local == 0xFFFFFFFF:
                vals = list(struct.unpack_from(f"<{(len(extra) - 4) // 8}Q", extra, 4)) \
                    if extra[:2] == b"\x01\x00" else []
                if csize == 0xFFFFFFFF and vals:
                    vals.pop(0)
                    csize = vals.pop(0) if vals else csize
                if local == 0xFFFFFFFF and vals:
                    local = vals.pop(0)
            p += CENTRAL.size + nlen + xlen + clen
            header = record + local
            if header + LOCAL.size > len(data):
                continue
            lnlen, lxlen = struct.unpack_from("<HH", data, header + 26)
            start = header + LOCAL.size + lnlen + lxlen
            if start + csize <= len(data):
                out.append(Entry(header, name, start, csize))
    return out


def _fix_crc(data: bytearray, entry: Entry) -> None:
    """Store the CRC-32 of ``entry``'s (changed, same-length) data in its local header and in
    the central directory record that names it."""
    crc = zlib.crc32(data[entry.data:entry.data + entry.size])
    struct.pack_into("<I", data, entry.header + 14, crc)
    needle = entry.name.encode()
    pos = data.find(b"PK\x01\x02", entry.data + entry.size)
    while pos >= 0:
        nlen = struct.unpack_from("<H", data, pos + 28)[0]
        if bytes(data[pos + CENTRAL.size:pos + CENTRAL.size + nlen]) == needle:
            struct.pack_into("<I", data, pos + 16, crc)
            return
        pos = data.find(b"PK\x01\x02", pos + 4)


def zip_op(rng: random.Random, data: bytes, marker: str) -> tuple[bytes, str, bool]:
    """Damage a file of torch.save zip records. Returns (bytes, detail, crc_protected)."""
    entries = zip_locals(data)
    if not entries:
        return (*_bytes_op(rng, data), False)
    storages = [e for e in entries if re.search(r"/data/\d+$", e.name) and e.size > 0]
    pickles = [e for e in entries if e.name.endswith("data.pkl")]
    op = rng.choice(("storage", "storage", "pickle", "pickle_fixed", "pickle_fixed",
                     "pickle_fixed", "header", "central", "eocd", "name", "bytes"))
    buf = bytearray(data)
    if op == "storage" and storages:
        e = rng.choice(storages)
        new, detail = flip(rng, data, e.data, e.data + e.size)
        return new, f"storage {e.name}: {detail}", True
    if op in ("pickle", "pickle_fixed") and pickles:
        e = rng.choice(pickles)
        old = data[e.data:e.data + e.size]
        new, detail = pickle_op(rng, old, marker)
        if len(new) != len(old):  # keep every offset: pad or cut with a harmless tail
            new = new[:len(old)] if len(new) > len(old) else new + b"." * (len(old) - len(new))
            detail += " (cut/padded to its length)"
        buf[e.data:e.data + e.size] = new
        if op == "pickle_fixed":
            _fix_crc(buf, e)
            detail += ", CRC fixed"
        return bytes(buf), f"{e.name}: {detail}", False
    if op == "header":
        e = rng.choice(entries)
        field, at, fmt = rng.choice((("csize", 18, "<I"), ("usize", 22, "<I"),
                                     ("name length", 26, "<H"), ("extra length", 28, "<H"),
                                     ("flags", 6, "<H"), ("method", 8, "<H")))
        value = rng.choice((0, 1, 0xFFFF, 0xFFFFFFFF, e.size + 1, e.size * 1000))
        value &= 0xFFFF if fmt == "<H" else 0xFFFFFFFF
        struct.pack_into(fmt, buf, e.header + at, value)
        return bytes(buf), f"local header {e.name}: {field} = {value}", False
    if op == "central":
        cds = [m.start() for m in re.finditer(b"PK\x01\x02", data)]
        if cds:
            pos = rng.choice(cds)
            field, at, fmt = rng.choice((("csize", 20, "<I"), ("usize", 24, "<I"),
                                         ("local offset", 42, "<I"), ("name length", 28, "<H"),
                                         ("extra length", 30, "<H"), ("method", 10, "<H"),
                                         ("crc", 16, "<I")))
            value = rng.choice((0, 1, 0xFFFF, 0xFFFFFFFF, 0x7FFFFFFF, len(data)))
            value &= 0xFFFF if fmt == "<H" else 0xFFFFFFFF
            struct.pack_into(fmt, buf, pos + at, value)
            return bytes(buf), f"central record at {pos}: {field} = {value}", False
    if op == "eocd":
        ends = [m.start() for m in re.finditer(b"PK\x05\x06", data)]
        if ends:
            pos = rng.choice(ends)
            field, at, fmt = rng.choice((("entries", 10, "<H"), ("entries on disk", 8, "<H"),
                                         ("directory size", 12, "<I"),
                                         ("directory offset", 16, "<I"),
                                         ("comment length", 20, "<H")))
            value = rng.choice((0, 1, 0xFFFF, 0xFFFFFFFF, len(data)))
            value &= 0xFFFF if fmt == "<H" else 0xFFFFFFFF
            struct.pack_into(fmt, buf, pos + at, value)
            return bytes(buf), f"end record at {pos}: {field} = {value}", False
    if op == "name":
        e = rng.choice(entries)
        old = e.name.encode()
        new = rng.choice((b"../../" + old, old.replace(b"data", b"dat\x00"), b"/" + old[1:],
                          old[::-1], b"x" * len(old)))[:len(old)].ljust(len(old), b"_")
        pos = data.find(old, e.header)
        buf[pos:pos + len(old)] = new
        return bytes(buf), f"entry {e.name} renamed {new!r}", False
    return (*_bytes_op(rng, data), False)


# --------------------------------------------------------------------------------------------
# JSON: safetensors headers and index files


def _json_value_op(rng: random.Random, obj: Any) -> tuple[Any, str]:
    choice = rng.choice(("huge", "neg", "str", "null", "list", "deep", "float", "big"))
    return {
        "huge": (2**64, "2**64"), "neg": (-1, "-1"), "str": ("x", "'x'"), "null": (None, "null"),
        "list": ([obj, obj], "a list"), "deep": ("DEEP", "100000-deep list"),
        "float": (1e308, "1e308"), "big": (10**400, "10**400"),
    }[choice]


def _dump(obj: Any) -> bytes:
    text = json.dumps(obj)
    return text.replace('"DEEP"', "[" * 100_000 + "]" * 100_000).encode()


def safetensors_op(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    header = _safetensors_header(data)
    if header is None:
        return _bytes_op(rng, data)
    (n,) = struct.unpack_from("<Q", data)
    body = data[8 + n:]
    tensors = [k for k in header if k != "__metadata__"]
    op = rng.choice(("offsets", "offsets", "shape", "shape", "dtype", "overlap", "length",
                     "meta", "name", "drop", "value", "notdict", "dupkey", "bytes",
                     "shift", "shift", "trailing", "hostile_name", "hostile_name"))
    detail = op
    if op == "trailing":  # issue 20 item 4: bytes after the last tensor
        extra = rng.choice((1, 2, 8, 4096))
        return data + rng.randbytes(extra), f"{extra} bytes after the data {UNTILED}"
    if op == "shift" and tensors:  # issue 20 item 4: one tensor moved, its length kept
        name = rng.choice(tensors)
        by = rng.choice((-2, 2, 1, -1, 4))
        begin, end = header[name]["data_offsets"]
        if begin + by >= 0:
            header[name]["data_offsets"] = [begin + by, end + by]
            return _same_length_header(header, n, body), f"{name} moved by {by} {UNTILED}"
    if op == "hostile_name" and tensors:  # issue 20 item 12: names that drive a terminal
        name = rng.choice(tensors)
        new_name = name + rng.choice(HOSTILE_TEXT)
        header[new_name] = header.pop(name)
        raw = _dump(header)
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + body, f"{name} renamed {new_name!r}"
    if op == "length":
        value = rng.choice((0, 1, n - 1, n + 1, len(data), 2**63, 2**64 - 1, 100_000_000))
        return struct.pack("<Q", value) + data[8:], f"header length field = {value}"
    if op == "bytes":
        new, d = flip(rng, data, 8, 8 + n)
        return new, f"header byte: {d}"
    if op == "notdict":
        text = rng.choice((b"[]", b"null", b"1", b'"x"', b"[" * 50_000 + b"]" * 50_000))
        return struct.pack("<Q", len(text)) + text + body, f"header is {text[:10]!r}"
    if op == "dupkey" and tensors:
        name = rng.choice(tensors)
        text = json.dumps(header)[:-1] + ", " + json.dumps({name: header[name]})[1:]
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw + body, f"{name} twice in the header"
    if not tensors:
        return _bytes_op(rng, data)
    name = rng.choice(tensors)
    entry = header[name]
    if op == "offsets":
        begin, end = entry["data_offsets"]
        new = rng.choice(([begin, len(body) + 1], [len(body) + 8, len(body) + 16],
                          [end, begin], [begin, 2**64], [-8, end], [begin, begin],
                          [0, len(body)], [begin + 1, end + 1], [begin, end, 3]))
        entry["data_offsets"] = new
        detail = f"{name} data_offsets {new}"
    elif op == "shape":
        new_shape = rng.choice(([2**40, 2**40], [2**62, 4], [-1], [0], [], [2**64],
                                [1] * 1000, [3, -5], ["a"], [1.5], None))
        entry["shape"] = new_shape
        detail = f"{name} shape {str(new_shape)[:40]}"
    elif op == "dtype":
        entry["dtype"] = rng.choice(("X99", "", "F8_E4M3", "C64", 7, None, "I4", "BOOL", "F64"))
        detail = f"{name} dtype {entry['dtype']!r}"
    elif op == "overlap" and len(tensors) > 1:
        other = header[rng.choice([t for t in tensors if t != name])]
        entry["data_offsets"] = list(other["data_offsets"])
        detail = f"{name} data_offsets copied from another tensor"
    elif op == "meta":
        header["__metadata__"] = rng.choice(({"format": 1}, [], {"format": "pt", "x": None},
                                             "pt", {"a" * 10: "b" * 10_000_000}))
        detail = "__metadata__ replaced"
    elif op == "name":
        new_name = rng.choice(("__metadata__", "", "../x", "a\udcff", "x" * 100_000))
        header[new_name] = header.pop(name)
        detail = f"{name} renamed {new_name[:12]!r}"
    elif op == "drop":
        del header[name]
        detail = f"{name} dropped from the header"
    else:
        key = rng.choice(("dtype", "shape", "data_offsets"))
        entry[key], what = _json_value_op(rng, entry.get(key))
        detail = f"{name} {key} = {what}"
    try:
        raw = _dump(header)
    except (ValueError, UnicodeEncodeError):
        raw = json.dumps(header, ensure_ascii=True).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body, detail


# Marks a mutant whose safetensors data area is no longer tiled exactly: no command may
# accept it (harness row "untiled").
UNTILED = "(untiled)"
# Text that moves a terminal's cursor, clears it, sets its title, forges a line or reverses
# what follows (issue 20 item 12).
HOSTILE_TEXT = ("\x1b[2J", "\x1b]0;owned\x07", "\r\nverify OK", "\u202egnp.exe", "\x07",
                "\x1b[31m", "\u2066x\u2069", "\x9b31m", "\x00")


def _same_length_header(header: dict[str, Any], n: int, body: bytes) -> bytes:
    """``header`` written back in ``n`` bytes (padded) when it fits, so the data does not
    move; else at its own length."""
    raw = _dump(header)
    if len(raw) <= n:
        return struct.pack("<Q", n) + raw.ljust(n) + body
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def json_op(rng: random.Random, data: bytes, name: str) -> tuple[bytes, str]:
    try:
        doc = json.loads(data)
    except ValueError:
        return _bytes_op(rng, data)
    if not isinstance(doc, dict):
        return _bytes_op(rng, data)
    wm = doc.get("weight_map")
    op = rng.choice(("target", "target", "weight_map", "total", "extra", "drop", "deep",
                     "bytes", "notdict"))
    if op == "target" and isinstance(wm, dict) and wm:
        key = rng.choice(sorted(wm))
        wm[key] = rng.choice(("../../../../etc/passwd", "/etc/passwd", "missing.safetensors",
                              ".", "", "config.json", name, "../" + str(wm[key]), 5,
                              "model.safetensors.index.json", "\x00"))
        detail = f"weight_map[{key}] = {wm[key]!r}"
    elif op == "weight_map":
        doc["weight_map"], detail = _json_value_op(rng, wm)
        detail = f"weight_map = {detail}"
    elif op == "total":
        doc.setdefault("metadata", {})["total_size"] = rng.choice((-1, 2**70, "x", 0, None))
        detail = "total_size changed"
    elif op == "extra" and isinstance(wm, dict) and wm:
        target = rng.choice(sorted(set(map(str, wm.values()))))
        for i in range(rng.choice((1, 100_000))):
            wm[f"ghost.{i}"] = target
        detail = "tensors the shards do not hold"
    elif op == "drop" and isinstance(wm, dict) and wm:
        del wm[rng.choice(sorted(wm))]
        detail = "a tensor dropped from the index"
    elif op == "deep":
        doc["metadata"] = "DEEP"
        detail = "metadata nested 100000 deep"
    elif op == "notdict":
        return rng.choice((b"[]", b"null", b"{", b"\xff\xfe")), "not a JSON object"
    else:
        return _bytes_op(rng, data)
    return _dump(doc), detail


def text_op(rng: random.Random, data: bytes, name: str) -> tuple[bytes, str]:
    if name.endswith("latest"):
        new = rng.choice((b"../../../etc", b"/etc", b"global_step999999999", b"",
                          b"global_step1/../../..", b"\xff" * 8, b"latest", b"x" * 5000))
        return new, f"latest -> {new[:20]!r}"
    return _bytes_op(rng, data)


# --------------------------------------------------------------------------------------------
# Structure: valid DCP .metadata pickles that lie


def metadata_structure_op(rng: random.Random, data: bytes, marker: str) -> tuple[bytes, str]:
    """Unpickle a (seed's, trusted) DCP ``.metadata`` with torch's classes, change what it
    says, and pickle it again."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorStorageMetadata,
    )

    try:
        md = pickle.loads(data)  # noqa: S301 - our own seed, written by dcp.save just now
    except Exception:  # noqa: BLE001
        return pickle_op(rng, data, marker)
    sd = md.state_dict_metadata
    tensors = [k for k, v in sd.items() if isinstance(v, TensorStorageMetadata)]
    storage = md.storage_data or {}
    op = rng.choice(("size", "size", "chunk", "chunk", "many", "storage", "storage", "path",
                     "dtype", "drop", "object", "trap", "huge", "claim", "claim"))
    detail = op
    if op == "huge" and tensors:  # issue 20 item 14: past int64, past printing
        k = rng.choice(tensors)
        big = rng.choice((10**400, 10**5000, 2**64, 2**63))
        dims = tuple(sd[k].size)
        sd[k].size = (big, *dims[1:]) if dims else (big,)  # a plain tuple: torch.Size refuses
        if rng.random() < 0.5 and sd[k].chunks:
            c = sd[k].chunks[0]
            sd[k].chunks[0] = ChunkStorageMetadata(offsets=c.offsets,
                                                   sizes=(big, *tuple(c.sizes)[1:]))
        detail = f"{k} dimension of {len(str(big)) if big < 10**4000 else 5001} digits"
    elif op == "claim" and tensors:  # issue 20 items 13, 16: a chunk claims far more bytes
        k = rng.choice(tensors)
        c = sd[k].chunks[0]
        factor = rng.choice((1 << 20, 1 << 26, 1 << 30))
        sizes = torch.Size([int(c.sizes[0]) * factor if c.sizes else factor,
                            *list(c.sizes)[1:]])
        sd[k].chunks[0] = ChunkStorageMetadata(offsets=c.offsets, sizes=sizes)
        sd[k] = dataclasses.replace(sd[k], size=torch.Size(
            [max(int(a), int(o) + int(z)) for a, o, z in zip(
                list(sd[k].size) or [0] * len(sizes), list(c.offsets) or [0] * len(sizes),
                sizes, strict=False)]))
        detail = f"{k} chunk 0 claims {factor}x its size"
    elif op == "size" and tensors:
        k = rng.choice(tensors)
        new = rng.choice((torch.Size([2**40, 2**40]), torch.Size([2**62, 16]),
                          torch.Size([0]), torch.Size([]), torch.Size([1] * 200),
                          torch.Size([-1, 4])))
        sd[k] = dataclasses.replace(sd[k], size=new)
        detail = f"{k} size {tuple(new)[:4]}"
    elif op == "chunk" and tensors:
        k = rng.choice(tensors)
        chunks = list(sd[k].chunks)
        i = rng.randrange(len(chunks))
        c = chunks[i]
        nd = len(c.sizes)
        offsets = torch.Size([rng.choice((0, -1, 2**40, 1)) for _ in range(nd)])
        sizes = torch.Size([rng.choice((0, 2**40, 2**62, 1, -3)) for _ in range(nd)])
        chunks[i] = ChunkStorageMetadata(offsets=rng.choice((offsets, c.offsets)),
                                         sizes=rng.choice((sizes, c.sizes)))
        sd[k].chunks[:] = chunks
        detail = f"{k} chunk {i} -> {chunks[i]}"
    elif op == "many" and tensors:
        # Millions of chunks claimed by a small file (pickle memo: one object many times).
        k = rng.choice(tensors)
        n = rng.choice((100_000, 2_000_000))
        sd[k].chunks[:] = [sd[k].chunks[0]] * n
        detail = f"{k}: {n:,} chunks (one object repeated)"
    elif op == "storage" and storage:
        idx = rng.choice(list(storage))
        info = storage[idx]
        field = rng.choice(("offset", "length"))
        value = rng.choice((2**40, 2**62, -1, 0, 10**9))
        storage[idx] = dataclasses.replace(info, **{field: value})
        detail = f"storage of {idx.fqn}: {field} = {value}"
    elif op == "path" and storage:
        idx = rng.choice(list(storage))
        new = rng.choice(("../../../../etc/passwd", "/etc/passwd", "..", "", "x" * 10000,
                          ".metadata", "__0_0.distcp/../../x"))
        storage[idx] = dataclasses.replace(storage[idx], relative_path=new)
        detail = f"storage of {idx.fqn}: relative_path {new[:24]!r}"
    elif op == "dtype" and tensors:
        k = rng.choice(tensors)
        props = dataclasses.replace(sd[k].properties, dtype=rng.choice(
            (torch.complex64, torch.float64, torch.int8, torch.uint8, torch.bool,
             torch.float8_e4m3fn, torch.qint8)))
        sd[k] = dataclasses.replace(sd[k], properties=props)
        detail = f"{k} dtype {props.dtype}"
    elif op == "drop" and storage:
        idx = rng.choice(list(storage))
        del storage[idx]
        detail = f"storage of {idx.fqn} dropped"
    elif op == "object" and tensors:
        k = rng.choice(tensors)
        sd[k] = BytesStorageMetadata()
        detail = f"{k} declared a non-tensor entry"
    else:
        module, name, arg = rng.choice(TRAPS)
        body = pickle.dumps(md, protocol=2)
        call = _trap_call(module, name, arg.format(marker=marker))
        return body[:2] + call + body[2:], f"{module}.{name} call in a valid .metadata"
    try:
        return pickle.dumps(md, protocol=rng.choice((2, 4))), detail
    except Exception as e:  # noqa: BLE001 - a value torch will not pickle
        return pickle_op(rng, data, marker), f"(unpicklable: {e})"


def torch_structure_op(rng: random.Random, data: bytes, marker: str) -> tuple[bytes, str]:
    """A valid torch.save file (one zip) whose pickle lies about shapes, strides, offsets or
    holds a forbidden call: rewritten whole with correct CRCs."""
    import zipfile

    try:
        zin = zipfile.ZipFile(io.BytesIO(data))
        names = zin.namelist()
        pkl = next(n for n in names if n.endswith("data.pkl"))
        old = zin.read(pkl)
    except Exception:  # noqa: BLE001 - not one zip: a record file
        return _bytes_op(rng, data)
    new, detail = pickle_op(rng, old, marker)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for n in names:
            zout.writestr(n, new if n == pkl else zin.read(n))
    return out.getvalue(), f"{detail}, archive rewritten (valid CRCs)"


# --------------------------------------------------------------------------------------------


def seed_files(root: Path) -> list[tuple[str, bytes]]:
    """Every regular file under ``root``, sorted, with its bytes."""
    return [(str(p.relative_to(root)), p.read_bytes()) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()]


_WEIGHT: dict[str, int] = {"pickle": 5, "zip": 4, "safetensors": 4, "json": 3, "records": 2,
                           "text": 1, "skip": 0}


def mutation(seed: str, files: list[tuple[str, bytes]], index: int, *, campaign: int = 0,
             marker: str) -> Mutant:
    """Mutant ``index`` of the seed whose files are ``files`` (deterministic)."""
    rng = random.Random(f"{campaign}:{seed}:{index}")
    kinds = [kind_of(name, data) for name, data in files]
    weights = [_WEIGHT[k] for k in kinds]
    i = rng.choices(range(len(files)), weights=weights)[0]
    name, data = files[i]
    kind = kinds[i]
    protected = False
    level = rng.random()
    if level < 0.03:
        return Mutant(index, seed, name, "remove", "file removed", None)
    if level < 0.25:
        new, detail = _bytes_op(rng, data)
        op = "bytes"
    elif kind == "pickle":
        if level < 0.6:
            new, detail = pickle_op(rng, data, marker)
            op = "pickle"
        else:
            new, detail = metadata_structure_op(rng, data, marker)
            op = "structure"
    elif kind == "zip":
        if level < 0.45 and data.count(b"PK\x05\x06") == 1:
            new, detail = torch_structure_op(rng, data, marker)
            op = "structure"
        else:
            new, detail, protected = zip_op(rng, data, marker)
            op = "zip"
    elif kind == "safetensors":
        new, detail = safetensors_op(rng, data)
        op = "safetensors-header"
    elif kind == "json":
        new, detail = json_op(rng, data, name)
        op = "json"
    elif kind == "text":
        new, detail = text_op(rng, data, name)
        op = "text"
    else:
        new, detail = _bytes_op(rng, data)
        op = "bytes"
    if op == "bytes" and detail.startswith("flip bit") and kind == "zip":
        at = int(detail.rsplit(" ", 1)[1])
        protected = any(e.data <= at < e.data + e.size for e in zip_locals(data)
                        if re.search(r"/data/\d+$", e.name))
    return Mutant(index, seed, name, op, detail, new, protected)


MutationFn = Callable[[random.Random, bytes], tuple[bytes, str]]
