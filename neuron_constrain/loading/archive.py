"""Archive checks: what a zip file holds, before anything in it is decoded.

    entries = check_zip(path)        # {name: ZipInfo}, or a LoadError naming the entry

Refused: a file that is not a zip (empty, truncated, damaged), entries that escape the
archive (``..``, absolute paths, backslashes), duplicates, encryption, compression
methods other than stored and deflate, a total uncompressed size over ``max_bytes``,
an entry compressed more than ``max_ratio`` times, entries whose bytes overlap (zip
bombs); in a ``.pt2``, compiled or executable entries (:func:`refuse_executables`) and
a nested ``torch.save`` zip that inflates past its entry (:func:`check_inner_zip`).
Entries are read with their checksum verified (:func:`read_entry`).
"""
from __future__ import annotations

import os
import re
import struct
import zipfile
import zlib
from typing import IO

from neuron_constrain.loading.errors import OPT_IN, RESAVE, LoadError, first_line

MAX_BYTES = 256 * 2**30  # total uncompressed size; ``load(..., max_bytes=...)`` raises it
MAX_RATIO = 100          # torch writes entries uncompressed (ratio 1); deflate reaches ~1000 on zeros

# Entries that hold native code or code torch would run, by name.
EXECUTABLE_SUFFIXES = (".so", ".dll", ".dylib", ".pyd", ".exe", ".pyc", ".py", ".sh", ".o", ".a", ".cubin", ".fatbin")
EXECUTABLE_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe", b"#!")


def check_zip(path: str, *, max_bytes: int = MAX_BYTES, max_ratio: float = MAX_RATIO, what: str = "a .pt2 archive",
              fix: str = RESAVE) -> dict[str, zipfile.ZipInfo]:
    """The entries of the zip file at ``path`` by name, once it passed the archive checks.

    Checks: a zip at all (not empty, not truncated), entry names inside the archive and
    unique, no two entries sharing bytes, no encryption, total uncompressed size at most
    ``max_bytes``, each entry over 1 MiB compressed at most ``max_ratio`` times.
    """
    path = os.fspath(path)
    _check_file(path, what)
    if os.path.getsize(path) == 0:
        raise LoadError(path, f"is empty, not {what}; {fix}")
    if not zipfile.is_zipfile(path):
        raise LoadError(path, f"is not {what} (not a zip file, or truncated); {fix}")
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            central_directory = archive.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error) as e:
        raise LoadError(path, f"is a damaged zip archive ({e}); {fix}") from e
    entries: dict[str, zipfile.ZipInfo] = {}
    total = 0
    for info in infos:
        name = info.filename
        reason = bad_name(name)
        if reason:
            raise LoadError(path, f"{reason}; refusing the archive (an entry must stay inside it)", name)
        if name in entries:
            raise LoadError(path, "appears twice in the archive; readers disagree on which one counts, refusing", name)
        if info.flag_bits & 0x1:
            raise LoadError(path, "is encrypted; a .pt2 never is", name)
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise LoadError(path, f"uses zip compression method {info.compress_type}; only stored and deflate are read", name)
        total += info.file_size
        if total > max_bytes:
            raise LoadError(path, f"brings the uncompressed size past {max_bytes} bytes (max_bytes); "
                                  "pass a larger max_bytes if the program really is that large", name)
        if info.file_size > 2**20 and info.file_size > max_ratio * max(info.compress_size, 1):
            raise LoadError(path, f"inflates {info.file_size / max(info.compress_size, 1):.0f}x "
                                  f"({info.compress_size} -> {info.file_size} bytes), past max_ratio={max_ratio}: "
                                  "a zip bomb, or pass a larger max_ratio", name)
        entries[name] = info
    _check_layout(path, infos, central_directory)
    return entries


def _check_file(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise LoadError(path, f"no such file; check the path ({what})")
    if os.path.isdir(path):
        raise LoadError(path, f"is a directory; pass {what}")
    if not os.access(path, os.R_OK):
        raise LoadError(path, "permission denied")


def bad_name(name: str) -> str | None:
    if not name or "\x00" in name:
        return "has an empty or NUL-containing name"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path"
    if "\\" in name:
        return "has a backslash in its name"
    if ".." in name.split("/"):
        return "has a '..' component, escaping the archive"
    return None


def _check_layout(path: str, infos: list[zipfile.ZipInfo], central_directory: int) -> None:
    """Each entry's bytes lie before the next entry and the central directory (no overlap bombs)."""
    ordered = sorted(infos, key=lambda i: i.header_offset)
    with open(path, "rb") as f:
        for info, following in zip(ordered, ordered[1:] + [None]):
            if not 0 <= info.header_offset < central_directory:
                raise LoadError(path, f"has its local header at byte {info.header_offset}, outside the entries "
                                      f"(0..{central_directory}); the archive is corrupt or crafted; {RESAVE}",
                                info.filename)
            f.seek(info.header_offset)
            header = f.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                raise LoadError(path, f"has no local header where the directory points; the archive is corrupt "
                                      f"(fails its checksum or was truncated); {RESAVE}", info.filename)
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            if f.read(name_length) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
                raise LoadError(path, "has a local header naming another file than the directory does; the archive is "
                                      f"corrupt or crafted; {RESAVE}", info.filename)
            end = info.header_offset + 30 + name_length + extra_length + info.compress_size
            limit = following.header_offset if following is not None else central_directory
            if end > limit:
                raise LoadError(path, "overlaps the next entry's bytes (an overlapping-entries zip bomb, or corrupt); "
                                      "refusing the archive", info.filename)


def read_entry(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytearray:
    """An entry's bytes, checksum verified (writable, so tensors may share them)."""
    return read_bytes(path, archive, info, info.file_size)


def read_bytes(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int) -> bytearray:
    """The first ``size`` bytes of an entry (all of them: checksum verified)."""
    buffer = bytearray(size)
    try:
        with archive.open(info) as f:
            n = f.readinto(buffer)
            if size == info.file_size and (n != size or f.read(1)):
                raise zipfile.BadZipFile(f"{n} bytes instead of {info.file_size}")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, zlib.error) as e:  # ValueError: decoding
        raise LoadError(path, f"fails its checksum: the archive is corrupt ({first_line(e)}); {RESAVE}",
                        info.filename) from e
    return buffer[:n]


def refuse_executables(path: str, archive: zipfile.ZipFile, root: str, entries: dict[str, zipfile.ZipInfo]) -> None:
    """Refuse compiled (AOTInductor, MTIA) entries, and entries executable by name or by their first bytes."""
    from torch.export.pt2_archive import constants as c

    payload_dirs = (root + c.WEIGHTS_DIR, root + c.CONSTANTS_DIR)
    for name, info in entries.items():
        inner = name[len(root):]
        if inner.startswith(c.AOTINDUCTOR_DIR) or inner.startswith(c.MTIA_DIR):
            raise LoadError(path, "is a compiled (AOTInductor) artifact; torch.export.load loads its shared library, "
                                  f"running native code; refusing; {OPT_IN}", name)
        if name.lower().endswith(EXECUTABLE_SUFFIXES):
            raise LoadError(path, f"is an executable or compiled file by its name; refusing; {OPT_IN}", name)
        if not name.startswith(payload_dirs) and 0 < info.file_size:
            head = bytes(read_bytes(path, archive, info, min(4, info.file_size)))
            if head.startswith(EXECUTABLE_MAGIC):
                raise LoadError(path, f"starts like an executable ({head!r}); refusing; {OPT_IN}", name)


def check_inner_zip(path: str, name: str, buffer: IO[bytes], max_ratio: float = MAX_RATIO) -> None:
    """A torch.save file inside the archive: its entries stay within the outer entry's size (no nested bomb)."""
    outer = len(buffer.getvalue())
    try:
        with zipfile.ZipFile(buffer) as inner:
            infos = inner.infolist()
    except Exception as e:
        raise LoadError(path, f"is a damaged torch.save file ({first_line(e)}); {RESAVE}", name) from e
    total = sum(i.file_size for i in infos)
    if total > max(max_ratio * outer, 2**20) or any(bad_name(i.filename) for i in infos):
        raise LoadError(path, f"is a torch.save file whose entries inflate to {total} bytes from {outer}, or escape it; "
                              "refusing", name)

