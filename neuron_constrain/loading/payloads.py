"""Payload decoding: a ``.pt2``'s tensors and example inputs, without unpickling.

    state_dict = read_payloads(path, archive, root, entries, "data/weights/", "data/weights/model_weights_config.json",
                               "weight")
    args, kwargs = read_example_inputs(path, info, data)   # data/sample_inputs/model.pt

Weights and constants are built from their raw bytes, as torch's ``_load_state_dict``
does, after every payload's size was checked against the tensors its config declares
(a ``float32[64, 8]`` weight is 2048 bytes, not 200 MB); pickled payloads and
custom-object constants are refused. Example inputs go through
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import io
import json
import zipfile

from neuron_constrain.loading.archive import bad_name, check_inner_zip, read_entry
from neuron_constrain.loading.errors import OPT_IN, RESAVE, LoadError, first_line


def read_payloads(path, archive, root, entries, directory: str, config_name: str, kind: str) -> dict:
    """The state dict or constants, built from raw bytes as torch's ``_load_state_dict`` does, minus pickles."""
    import torch
    from torch._export.serde import schema
    from torch._export.serde.serialize import (_dict_to_dataclass, deserialize_device, deserialize_scalar_type,
                                               deserialize_size, deserialize_storage_offset, deserialize_stride)
    from torch.export.pt2_archive import constants as c

    config_entry = root + config_name
    if config_entry not in entries:
        raise LoadError(path, f"is not a loadable exported program: it has no {config_entry} entry; {RESAVE}")
    raw = read_entry(path, archive, entries[config_entry])
    try:
        config = _dict_to_dataclass(schema.PayloadConfig, json.loads(bytes(raw).decode("utf-8"))).config
        metas = dict(config)
    except Exception as e:
        raise LoadError(path, f"is not a valid payload config ({first_line(e)}); {RESAVE}", config_entry) from e

    reaches: dict[str, int] = {}  # path_name -> bytes its views reach
    declared: dict[str, str] = {}  # fqn -> "float32[64, 8]"
    for fqn, meta in metas.items():
        name = meta.path_name
        payload = f"{root}{directory}{name}"
        if not isinstance(name, str) or bad_name(name) or "/" in name:
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
            raise LoadError(path, f"declares {kind} {fqn!r} with an unreadable tensor meta ({first_line(e)}); {RESAVE}",
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
            data = read_entry(path, archive, entries[f"{root}{directory}{meta.path_name}"])
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


def read_example_inputs(path: str, info: zipfile.ZipInfo, data: bytearray):
    """``(args, kwargs)`` from ``data/sample_inputs/<model>.pt`` through ``torch.load(weights_only=True)``."""
    import pickle

    import torch

    if not data:
        return None
    buffer = io.BytesIO(bytes(data))
    if zipfile.is_zipfile(buffer):
        check_inner_zip(path, info.filename, buffer)
    try:
        value = torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise LoadError(path, f"holds objects a weights-only load refuses ({unpickling_reason(e)}); torch.export.load would "
                              f"unpickle them with weights_only=False (it can run code); refusing; {OPT_IN}",
                        info.filename) from e
    except Exception as e:
        raise LoadError(path, f"is not a readable torch.save file ({first_line(e)}); {RESAVE}", info.filename) from e
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict)):
        raise LoadError(path, f"is not (args, kwargs) example inputs but {type(value).__name__}; {RESAVE}", info.filename)
    return value


def unpickling_reason(e: BaseException) -> str:
    """The line of torch's weights-only refusal that names the object (e.g. ``unsupported GLOBAL posix.system``)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    named = [l for l in lines if "GLOBAL" in l or "Unsupported" in l or "WeightsUnpickler" in l]
    return (named or lines or [type(e).__name__])[0].rstrip(".")

