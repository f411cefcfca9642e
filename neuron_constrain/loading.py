"""Load a saved program (``.pt2``) without letting the file run code.

    program = neuron_constrain.load("step.pt2")                     # untrusted files: nothing in them runs
    program = neuron_constrain.load("step.pt2", allow_pickle=True)  # a file you trust: torch.export.load

``torch.export.load`` runs code a ``.pt2`` carries: it unpickles with
``weights_only=False`` the weights and constants whose config says ``use_pickle``,
the legacy ``data/weights/<model>.pt`` / ``data/constants/<model>.pt`` files, the
example inputs ``data/sample_inputs/<model>.pt`` and custom-object constants; loads
AOTInductor shared libraries under ``data/aotinductor/``; ``sympify``-s (``eval``)
every symbolic expression in ``models/<model>.json``; ``ep.module()`` ``exec``-s the
program's ``guards_code``; and calls every node target the graph names when it runs.

``load`` reads the archive with Python's ``zipfile`` and inspects it before anything
in it is decoded; torch never opens the file. It refuses, with a :class:`LoadError`
naming the entry, the reason and the opt-in:

- entries that escape the archive (``..``, absolute paths), duplicates, entries
  outside the archive's root folder or overlapping each other, a total uncompressed
  size over ``max_bytes``, an entry compressed more than ``max_ratio`` times;
- anything torch would unpickle (above), compiled or executable artifacts;
- weight / constant payloads whose size disagrees with the tensors their config
  declares (a ``float32[64, 8]`` weight is 2048 bytes, not 200 MB);
- symbolic expressions that are not sympy ``srepr`` text of known functions, guards
  that are not shape comparisons, node targets that are not operators.

Then it builds the state dict and constants from the raw bytes, loads the example
inputs with ``torch.load(weights_only=True)`` and hands everything to torch's own
deserializer, so a normally saved program loads exactly as ``torch.export.load``
loads it. ``allow_pickle=True`` keeps the archive checks (names, sizes) and then
calls ``torch.export.load`` itself. :func:`check_zip` is the archive part alone.
"""
from __future__ import annotations

import ast
import io
import json
import os
import re
import struct
import zipfile
import zlib
from typing import IO, Iterable

MAX_BYTES = 256 * 2**30  # total uncompressed size; ``load(..., max_bytes=...)`` raises it
MAX_RATIO = 100          # torch writes entries uncompressed (ratio 1); deflate reaches ~1000 on zeros

OPT_IN = "if you trust this file, pass allow_pickle=True (CLI: --allow-pickle)"
RESAVE = "save the program again with torch.export.save(program, path)"

# Entries that hold native code or code torch would run, by name.
EXECUTABLE_SUFFIXES = (".so", ".dll", ".dylib", ".pyd", ".exe", ".pyc", ".py", ".sh", ".o", ".a", ".cubin", ".fatbin")
EXECUTABLE_MAGIC = (b"\x7fELF", b"MZ", b"\xcf\xfa\xed\xfe", b"\xce\xfa\xed\xfe", b"\xca\xfe\xba\xbe", b"#!")


class LoadError(ValueError):
    """A file ``load`` will not read: names the file, the entry, the reason and the fix."""

    def __init__(self, path: str, reason: str, entry: str | None = None):
        self.path, self.reason, self.entry = path, reason, entry
        where = f"{path}: entry {entry!r}" if entry else str(path)
        super().__init__(f"{where} {reason}")


# ----------------------------------------------------------------------------- the archive

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
        reason = _bad_name(name)
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


def _bad_name(name: str) -> str | None:
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


def _read(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytearray:
    """An entry's bytes, checksum verified (writable, so tensors may share them)."""
    return _read_bytes(path, archive, info, info.file_size)


def _read_bytes(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo, size: int) -> bytearray:
    buffer = bytearray(size)
    try:
        with archive.open(info) as f:
            n = f.readinto(buffer)
            if size == info.file_size and (n != size or f.read(1)):
                raise zipfile.BadZipFile(f"{n} bytes instead of {info.file_size}")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, zlib.error) as e:  # ValueError: decoding
        raise LoadError(path, f"fails its checksum: the archive is corrupt ({_first_line(e)}); {RESAVE}",
                        info.filename) from e
    return buffer[:n]


# ----------------------------------------------------------------------------- load

def load(path: str | os.PathLike, *, allow_pickle: bool = False, max_bytes: int = MAX_BYTES,
         max_ratio: float = MAX_RATIO):
    """The ``ExportedProgram`` saved at ``path``, read without running anything the file holds.

    Raises :class:`LoadError` (one line: the entry, the reason, the fix). With
    ``allow_pickle=True`` (a file you trust) the archive checks still run, then
    ``torch.export.load`` reads it, pickles and all.
    """
    path = os.fspath(path)
    entries = check_zip(path, max_bytes=max_bytes, max_ratio=max_ratio)
    roots = {name.split("/", 1)[0] for name in entries}
    legacy = "version" in entries or "serialized_exported_program.json" in entries
    if allow_pickle:
        return _torch_load(path)
    if legacy:
        raise LoadError(path, "is in the legacy (torch <= 2.6) export format, whose weights, constants and example "
                              f"inputs are pickles torch.export.load would run; re-save it with a current torch, or {OPT_IN}")
    if len(roots) != 1 or any("/" not in name for name in entries):
        raise LoadError(path, "is not a .pt2 archive: its entries are not all inside one root folder; " + RESAVE)
    root = roots.pop() + "/"
    with zipfile.ZipFile(path) as archive:
        return _load_pt2(path, archive, root, entries)


def _torch_load(path: str):
    import torch

    try:
        return torch.export.load(path)
    except Exception as e:
        raise _not_a_program(path, e) from e


def _not_a_program(path: str, e: Exception) -> LoadError:
    text = str(e).strip()
    reason = text.splitlines()[0] if text else type(e).__name__
    return LoadError(path, f"is a zip archive but not a loadable exported program ({reason}); "
                           "write it with torch.export.save(torch.export.export(model, args), path)")


def _load_pt2(path: str, archive: zipfile.ZipFile, root: str, entries: dict[str, zipfile.ZipInfo]):
    from torch.export.pt2_archive import constants as c

    def entry(name: str, required: bool = True) -> zipfile.ZipInfo | None:
        info = entries.get(root + name)
        if info is None and required:
            raise LoadError(path, f"is not a loadable exported program: it has no {root + name} entry; {RESAVE}")
        return info

    def text(name: str) -> str:
        info = entry(name)
        try:
            return bytes(_read(path, archive, info)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise LoadError(path, f"is not UTF-8 text ({e}); the archive is corrupt; {RESAVE}", info.filename) from e

    if text(c.ARCHIVE_FORMAT_PATH) != c.ARCHIVE_FORMAT_VALUE:
        raise LoadError(path, f"is not a .pt2 archive ({root}{c.ARCHIVE_FORMAT_PATH} is not 'pt2'); {RESAVE}")
    version = text(c.ARCHIVE_VERSION_PATH)
    if version != c.ARCHIVE_VERSION_VALUE:
        raise LoadError(path, f"has archive version {version!r}; this torch reads version {c.ARCHIVE_VERSION_VALUE!r}; "
                              "save it with the torch that loads it")
    _refuse_executables(path, archive, root, entries)
    model = "model"
    for legacy in (f"{c.WEIGHTS_DIR}{model}.pt", f"{c.CONSTANTS_DIR}{model}.pt"):
        if entry(legacy, required=False) is not None:
            raise LoadError(path, f"is a legacy pickled {legacy.split('/')[1]} file, which torch.export.load unpickles "
                                  f"with weights_only=False (it can run code); refusing; {OPT_IN}", root + legacy)
    weights = _payloads(path, archive, root, entries, c.WEIGHTS_DIR, c.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model), "weight")
    constants = _payloads(path, archive, root, entries, c.CONSTANTS_DIR, c.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model),
                          "constant")
    program_json = _read(path, archive, entry(c.MODELS_FILENAME_FORMAT.format(model)))
    _check_program_json(path, root + c.MODELS_FILENAME_FORMAT.format(model), program_json)
    sample_inputs = entry(c.SAMPLE_INPUTS_FILENAME_FORMAT.format(model))
    example_inputs = _example_inputs(path, sample_inputs, _read(path, archive, sample_inputs))

    from torch._export.serde.serialize import SerializedArtifact, deserialize

    try:
        return deserialize(SerializedArtifact(bytes(program_json), weights, constants, example_inputs))
    except Exception as e:
        raise _not_a_program(path, e) from e


def _refuse_executables(path: str, archive: zipfile.ZipFile, root: str, entries: dict[str, zipfile.ZipInfo]) -> None:
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
            head = bytes(_read_bytes(path, archive, info, min(4, info.file_size)))
            if head.startswith(EXECUTABLE_MAGIC):
                raise LoadError(path, f"starts like an executable ({head!r}); refusing; {OPT_IN}", name)


# ----------------------------------------------------------------------------- weights and constants

def _payloads(path, archive, root, entries, directory: str, config_name: str, kind: str) -> dict:
    """The state dict or constants, built from raw bytes as torch's ``_load_state_dict`` does, minus pickles."""
    import torch
    from torch._export.serde import schema
    from torch._export.serde.serialize import (_dict_to_dataclass, deserialize_device, deserialize_scalar_type,
                                               deserialize_size, deserialize_storage_offset, deserialize_stride)
    from torch.export.pt2_archive import constants as c

    config_entry = root + config_name
    if config_entry not in entries:
        raise LoadError(path, f"is not a loadable exported program: it has no {config_entry} entry; {RESAVE}")
    raw = _read(path, archive, entries[config_entry])
    try:
        config = _dict_to_dataclass(schema.PayloadConfig, json.loads(bytes(raw).decode("utf-8"))).config
        metas = dict(config)
    except Exception as e:
        raise LoadError(path, f"is not a valid payload config ({_first_line(e)}); {RESAVE}", config_entry) from e

    reaches: dict[str, int] = {}  # path_name -> bytes its views reach
    declared: dict[str, str] = {}  # fqn -> "float32[64, 8]"
    for fqn, meta in metas.items():
        name = meta.path_name
        payload = f"{root}{directory}{name}"
        if not isinstance(name, str) or _bad_name(name) or "/" in name:
            raise LoadError(path, f"names payload {name!r} for {kind} {fqn!r}, which escapes {directory}; refusing",
                            config_entry)
        if kind == "constant" and name.startswith(c.CUSTOM_OBJ_FILENAME_PREFIX):
            raise LoadError(path, f"is a custom-object constant ({fqn!r}), a TorchScript pickle torch.export.load "
                                  f"would run; refusing; {OPT_IN}", payload)
        if kind == "constant" and not name.startswith(c.TENSOR_CONSTANT_FILENAME_PREFIX):
            raise LoadError(path, f"is constant {fqn!r} of an unknown kind (torch reads only tensor_* and custom_obj_*); "
                                  + RESAVE, payload)
        if meta.use_pickle:
            raise LoadError(path, f"is a pickled {kind} ({fqn!r}: use_pickle true in {config_entry}), which "
                                  f"torch.export.load unpickles with weights_only=False (it can run code); refusing; "
                                  f"{OPT_IN}", payload)
        if payload not in entries:
            raise LoadError(path, f"is missing: {kind} {fqn!r} is stored there by {config_entry}; {RESAVE}", payload)
        try:
            tm = meta.tensor_meta
            sizes = [_as_int(s) for s in tm.sizes]
            strides = [_as_int(s) for s in tm.strides]
            offset = _as_int(tm.storage_offset)
            dtype = deserialize_scalar_type(tm.dtype)
        except Exception as e:
            raise LoadError(path, f"declares {kind} {fqn!r} with an unreadable tensor meta ({_first_line(e)}); {RESAVE}",
                            config_entry) from e
        item = torch.empty((), dtype=dtype).element_size()
        reach = 0 if 0 in sizes else (offset + sum((n - 1) * s for n, s in zip(sizes, strides)) + 1) * item
        if any(s < 0 for s in strides) or offset < 0 or any(n < 0 for n in sizes):
            raise LoadError(path, f"declares {kind} {fqn!r} with negative sizes or strides; {RESAVE}", config_entry)
        reaches[name] = max(reaches.get(name, 0), reach)
        declared[fqn] = f"{str(dtype).replace('torch.', '')}{sizes}"
        size = entries[payload].file_size
        if size % item:
            raise LoadError(path, f"holds {size} bytes, not a whole number of {declared[fqn]} elements "
                                  f"({kind} {fqn!r})", payload)

    for name, reach in reaches.items():
        payload = f"{root}{directory}{name}"
        size = entries[payload].file_size
        if size == 0:  # torch saves fake tensors as empty payloads and loads zeros
            continue
        users = ", ".join(f"{fqn!r} {declared[fqn]}" for fqn, m in metas.items() if m.path_name == name)
        if size < reach:
            raise LoadError(path, f"holds {size} bytes but {kind} {users} needs {reach}; the archive is corrupt; "
                            + RESAVE, payload)
        if size > reach + max(reach, 4096):
            raise LoadError(path, f"inflates to {size} bytes but its config declares {kind} {users}, {reach} bytes; "
                                  "refusing to read it (a payload may exceed its tensors by at most 2x)", payload)

    files: dict[str, object] = {}
    result = {}
    for fqn, meta in metas.items():
        tm = meta.tensor_meta
        if meta.path_name not in files:
            data = _read(path, archive, entries[f"{root}{directory}{meta.path_name}"])
            dtype, device = deserialize_scalar_type(tm.dtype), deserialize_device(tm.device)
            if len(data):
                flat = torch.frombuffer(data, dtype=dtype, requires_grad=tm.requires_grad).to(device)
            else:
                flat = torch.zeros(deserialize_size(tm.sizes), dtype=dtype, device=device)
            files[meta.path_name] = flat
        tensor = torch.as_strided(files[meta.path_name], deserialize_size(tm.sizes), deserialize_stride(tm.strides),
                                  deserialize_storage_offset(tm.storage_offset))
        if meta.is_param:  # as torch.export.load does: torch 2.9 always requires grad, newer keep the saved flag
            tensor = torch.nn.Parameter(tensor, requires_grad=tm.requires_grad or not _parameters_keep_requires_grad())
        result[fqn] = tensor
    return result


def _parameters_keep_requires_grad() -> bool:
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 10)


def _as_int(value) -> int:
    if value.type != "as_int":
        raise ValueError(f"a symbolic size ({value.type}) in a stored tensor")
    return int(value.as_int)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- example inputs

def _example_inputs(path: str, info: zipfile.ZipInfo, data: bytearray):
    """``(args, kwargs)`` from ``data/sample_inputs/<model>.pt`` through ``torch.load(weights_only=True)``."""
    import pickle

    import torch

    if not data:
        return None
    buffer = io.BytesIO(bytes(data))
    if zipfile.is_zipfile(buffer):
        _check_inner_zip(path, info.filename, buffer)
    try:
        value = torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise LoadError(path, f"holds objects a weights-only load refuses ({_unpickling_reason(e)}); torch.export.load would "
                              f"unpickle them with weights_only=False (it can run code); refusing; {OPT_IN}",
                        info.filename) from e
    except Exception as e:
        raise LoadError(path, f"is not a readable torch.save file ({_first_line(e)}); {RESAVE}", info.filename) from e
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict)):
        raise LoadError(path, f"is not (args, kwargs) example inputs but {type(value).__name__}; {RESAVE}", info.filename)
    return value


def _unpickling_reason(e: BaseException) -> str:
    """The line of torch's weights-only refusal that names the object (e.g. ``unsupported GLOBAL posix.system``)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    named = [l for l in lines if "GLOBAL" in l or "Unsupported" in l or "WeightsUnpickler" in l]
    return (named or lines or [type(e).__name__])[0].rstrip(".")


def _check_inner_zip(path: str, name: str, buffer: IO[bytes], max_ratio: float = MAX_RATIO) -> None:
    """A torch.save file inside the archive: its entries stay within the outer entry's size (no nested bomb)."""
    outer = len(buffer.getvalue())
    try:
        with zipfile.ZipFile(buffer) as inner:
            infos = inner.infolist()
    except Exception as e:
        raise LoadError(path, f"is a damaged torch.save file ({_first_line(e)}); {RESAVE}", name) from e
    total = sum(i.file_size for i in infos)
    if total > max(max_ratio * outer, 2**20) or any(_bad_name(i.filename) for i in infos):
        raise LoadError(path, f"is a torch.save file whose entries inflate to {total} bytes from {outer}, or escape it; "
                              "refusing", name)


# ----------------------------------------------------------------------------- the program JSON

_SYMPY_CALLS = {
    "Symbol", "Dummy", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "floor",
    "ceiling", "Equality", "Unequality", "StrictLessThan", "LessThan", "StrictGreaterThan", "GreaterThan", "And",
    "Or", "Not", "Xor", "Piecewise", "ExprCondPair", "Tuple", "sqrt",
    # torch.utils._sympy.functions
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift",
    "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
}
_SYMPY_OPAQUE = re.compile(r"(OpaqueUnaryFn|BitwiseFn)_[a-z0-9_]+$")
_SYMPY_CONSTANTS = {"oo", "zoo", "nan", "true", "false", "pi", "E", "int_oo"}
_SYMPY_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z][A-Za-z0-9_]*)|(?P<int>-?\d{1,40})|(?P<str>'[A-Za-z0-9_.+\-]{0,64}')"
                          r"|(?P<punct>[(),=-]))")
_MAX_EXPRESSION = 20_000


def _bad_sympy(expr: str) -> str | None:
    """Why ``expr`` is not sympy ``srepr`` text torch would ``sympify`` harmlessly, or None."""
    if not isinstance(expr, str) or len(expr) > _MAX_EXPRESSION:
        return "is not a short string"
    tokens, at = [], 0
    while at < len(expr):
        match = _SYMPY_TOKEN.match(expr, at)
        if not match or match.end() == at:
            if expr[at:].strip() == "":
                break
            return f"has {expr[at:at + 20]!r}, which srepr never writes"
        tokens.append((match.lastgroup, match.group(match.lastgroup)))
        at = match.end()
    position = 0

    def peek(kind=None, value=None):
        if position >= len(tokens):
            return False
        k, v = tokens[position]
        return (kind is None or k == kind) and (value is None or v == value)

    def take(kind=None, value=None):
        nonlocal position
        if not peek(kind, value):
            raise ValueError(f"expected {value or kind} at token {position}")
        position += 1
        return tokens[position - 1][1]

    def expression(depth):
        if depth > 200:
            raise ValueError("nests too deep")
        if peek("punct", "-"):
            take()
            name = take("name")
            if name not in _SYMPY_CONSTANTS:
                raise ValueError(f"-{name} is not a sympy constant")
            return
        if peek("int") or peek("str"):
            take()
            return
        name = take("name")
        if not peek("punct", "("):
            if name not in _SYMPY_CONSTANTS:
                raise ValueError(f"{name!r} is not a sympy constant")
            return
        if name not in _SYMPY_CALLS and not _SYMPY_OPAQUE.match(name):
            raise ValueError(f"{name!r} is not a sympy function torch writes")
        take("punct", "(")
        while not peek("punct", ")"):
            if peek("name") and position + 1 < len(tokens) and tokens[position + 1] == ("punct", "="):
                keyword = take("name")
                if not re.fullmatch(r"[a-z][a-z_]*", keyword):
                    raise ValueError(f"keyword {keyword!r}")
                take("punct", "=")
                if peek("name"):
                    if take("name") not in ("True", "False", "None"):
                        raise ValueError("a keyword value must be True, False, None, a number or a string")
                else:
                    take("int") if peek("int") else take("str")
            else:
                expression(depth + 1)
            if not peek("punct", ")"):
                take("punct", ",")
        take("punct", ")")

    try:
        expression(0)
        if position != len(tokens):
            raise ValueError("trailing text")
    except ValueError as e:
        return f"is not sympy srepr text ({e})"
    return None


_GUARD_METHODS = {"size", "stride", "storage_offset", "dim", "numel"}
_GUARD_FUNCTIONS = {"Max", "Min", "FloorDiv", "Mod", "PythonMod", "Eq", "Ne", "CeilToInt", "FloorToInt", "TruncToInt",
                    "ToFloat", "IntTrueDiv", "FloatTrueDiv", "Abs", "sym_max", "sym_min", "sym_float", "sym_int"}
_GUARD_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Subscript,
                ast.Attribute, ast.Call, ast.Load, ast.And, ast.Or, ast.Not, ast.USub, ast.UAdd, ast.Add, ast.Sub,
                ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
                ast.Tuple)


def _bad_guard(code: str) -> str | None:
    """Why ``code`` is not an input-shape guard like ``L['x'].size()[0] <= 64``, or None (``ep.module()`` execs it)."""
    if not isinstance(code, str) or len(code) > _MAX_EXPRESSION:
        return "is not a short string"
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError as e:
        return f"is not a Python expression ({e.msg})"
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            return f"uses {type(node).__name__}, which a shape guard never does"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool)):
            return f"has the constant {node.value!r}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not re.fullmatch(r"\w{0,128}", node.value):
            return f"has the string {node.value!r}"
        if isinstance(node, ast.Name) and node.id not in {"L", "math", *_GUARD_FUNCTIONS}:
            return f"names {node.id!r}"
        if isinstance(node, ast.Attribute):
            is_math = isinstance(node.value, ast.Name) and node.value.id == "math"
            if not (node.attr in _GUARD_METHODS or (is_math and node.attr in {"inf", "floor", "ceil", "trunc", "sqrt"})):
                return f"reads the attribute {node.attr!r}"
        if isinstance(node, ast.Call):
            if node.keywords or (isinstance(node.func, ast.Attribute) and node.func.attr in _GUARD_METHODS and node.args):
                return "calls with arguments a shape guard never passes"
            if not isinstance(node.func, (ast.Attribute, ast.Name)):
                return "calls something computed"
    return None


def _allowed_python_targets() -> list:
    import math
    import operator

    import torch

    found = [operator.getitem, operator.add, operator.mul, operator.sub, operator.truediv, operator.ge, operator.le,
             operator.gt, operator.lt, operator.eq, operator.ne, operator.floordiv, operator.mod, operator.and_,
             operator.or_, operator.not_, operator.pow, operator.neg, operator.abs, operator.lshift, operator.rshift,
             math.ceil, math.floor, math.trunc, round]
    # torch's verifier allowlist of Python functions (those this torch has)
    for owner, name in [(torch, "sym_int"), (torch, "sym_float"), (torch, "sym_ite"), (torch, "sym_max"),
                        (torch, "sym_min"), (torch, "sym_not"), (torch, "sym_sqrt"), (torch, "sym_sum"),
                        (torch._C, "_set_grad_enabled"), (torch.autograd.grad_mode, "set_grad_enabled"),
                        (torch.amp.autocast_mode, "_enter_autocast"), (torch.amp.autocast_mode, "_exit_autocast")]:
        if hasattr(owner, name):
            found.append(getattr(owner, name))
    return found


def _bad_target(target: str, allowed: list) -> str | None:
    """Why the node target ``target`` is not an operator (resolved the way torch's deserializer resolves it), or None."""
    import math
    import operator

    import torch

    if not isinstance(target, str):
        return "is not a string"
    if target.startswith("#"):
        return "is an extension operator torch resolves through a registry"
    if target.startswith("_operator"):
        obj, parts = operator, target.split(".")[1:]
    elif target.startswith("torch"):
        obj, parts = torch, target.split(".")[1:]
    elif target.startswith("math"):
        obj, parts = math, target.split(".")[1:]
    else:
        return None  # torch keeps it as a string: nothing is called
    if parts[:1] == ["ops"] and len(parts) < 3:
        return "is not an operator (torch.ops.<namespace>.<op>)"
    for part in parts:
        try:
            if not hasattr(obj, part):
                return None  # unresolved: torch keeps the string
            obj = getattr(obj, part)
        except Exception:
            return None
    from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

    if isinstance(obj, (OpOverload, OpOverloadPacket, HigherOrderOperator)):
        return None
    if any(obj is a for a in allowed):
        return None
    return f"resolves to {type(obj).__name__} {getattr(obj, '__name__', '?')!r}, not an operator the verifier allows"


def _check_program_json(path: str, name: str, data: bytearray) -> None:
    """Refuse the program JSON's strings torch would eval, exec or call: expressions, guards, node targets."""
    try:
        program = json.loads(bytes(data).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise LoadError(path, f"is not JSON ({_first_line(e)}); the archive is corrupt; {RESAVE}", name) from e
    if not isinstance(program, dict):
        raise LoadError(path, f"is not a serialized exported program; {RESAVE}", name)
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise LoadError(path, "has guards_code that is not a list; refusing", name)
    for guard in guards:
        reason = _bad_guard(guard)
        if reason:
            raise LoadError(path, f"has guard {str(guard)[:80]!r}, which {reason}; ep.module() would exec it; "
                                  f"refusing; {OPT_IN}", name)
    allowed = _allowed_python_targets()
    for node in _walk(program):
        if "expr_str" in node:
            reason = _bad_sympy(node["expr_str"])
            if reason:
                raise LoadError(path, f"has the symbolic expression {str(node['expr_str'])[:80]!r}, which {reason}; "
                                      f"torch would eval it with sympify; refusing; {OPT_IN}", name)
        if "target" in node and "inputs" in node and "outputs" in node:
            reason = _bad_target(node["target"], allowed)
            if reason:
                raise LoadError(path, f"has a node calling {str(node['target'])[:80]!r}, which {reason}; "
                                      f"refusing; {OPT_IN}", name)


def _walk(value) -> Iterable[dict]:
    """Every dict inside a JSON value, without recursion (deep nesting cannot overflow the stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
