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
calls ``torch.export.load`` itself.

The checks, one module each: ``archive`` (the zip itself: names, sizes, bombs,
executables; its ``check_zip`` is that part alone), ``payloads`` (weights, constants
and example inputs from raw bytes), ``program_json`` (expressions, guards, node targets).
"""
from __future__ import annotations

import os
import zipfile

from neuron_constrain.loading.archive import MAX_BYTES, MAX_RATIO, check_zip, read_entry, refuse_executables
from neuron_constrain.loading.errors import OPT_IN, RESAVE, LoadError
from neuron_constrain.loading.payloads import read_example_inputs, read_payloads
from neuron_constrain.loading.program_json import check_program_json

__all__ = ["LoadError", "load"]


def load(path: str | os.PathLike, *, allow_pickle: bool = False, max_bytes: int = MAX_BYTES,
         max_ratio: float = MAX_RATIO):
    """The ``ExportedProgram`` saved at ``path``, read without running anything the file holds.

    Args:
        path: a ``.pt2`` written by ``torch.export.save``.
        allow_pickle: for a file you trust: the archive checks still run, then
            ``torch.export.load`` reads it, pickles and all.
        max_bytes: the most the archive's entries may hold, uncompressed.
        max_ratio: the highest compression ratio an entry may have (a zip bomb's is far higher).

    Returns:
        The program, as ``torch.export.load`` would return it for a normally saved file.

    Raises:
        LoadError: one line naming the entry, the reason and the fix: pickled payloads,
            executables, entries escaping the archive, zip bombs, expressions or guards that are
            not plain data, node targets that are not operators.
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
            return bytes(read_entry(path, archive, info)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise LoadError(path, f"is not UTF-8 text ({e}); the archive is corrupt; {RESAVE}", info.filename) from e

    if text(c.ARCHIVE_FORMAT_PATH) != c.ARCHIVE_FORMAT_VALUE:
        raise LoadError(path, f"is not a .pt2 archive ({root}{c.ARCHIVE_FORMAT_PATH} is not 'pt2'); {RESAVE}")
    version = text(c.ARCHIVE_VERSION_PATH)
    if version != c.ARCHIVE_VERSION_VALUE:
        raise LoadError(path, f"has archive version {version!r}; this torch reads version {c.ARCHIVE_VERSION_VALUE!r}; "
                              "save it with the torch that loads it")
    refuse_executables(path, archive, root, entries)
    model = "model"
    for legacy in (f"{c.WEIGHTS_DIR}{model}.pt", f"{c.CONSTANTS_DIR}{model}.pt"):
        if entry(legacy, required=False) is not None:
            raise LoadError(path, f"is a legacy pickled {legacy.split('/')[1]} file, which torch.export.load unpickles "
                                  f"with weights_only=False (it can run code); refusing; {OPT_IN}", root + legacy)
    weights = read_payloads(path, archive, root, entries, c.WEIGHTS_DIR, c.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model),
                            "weight")
    constants = read_payloads(path, archive, root, entries, c.CONSTANTS_DIR,
                              c.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model), "constant")
    program_json = read_entry(path, archive, entry(c.MODELS_FILENAME_FORMAT.format(model)))
    check_program_json(path, root + c.MODELS_FILENAME_FORMAT.format(model), program_json)
    sample_inputs = entry(c.SAMPLE_INPUTS_FILENAME_FORMAT.format(model))
    example_inputs = read_example_inputs(path, sample_inputs, read_entry(path, archive, sample_inputs))

    from torch._export.serde.serialize import SerializedArtifact, deserialize

    try:
        return deserialize(SerializedArtifact(bytes(program_json), weights, constants, example_inputs))
    except Exception as e:
        raise _not_a_program(path, e) from e

