"""Reference captures on disk without pickle: safetensors for the tensors, JSON for the rest.

    save_captures("captures.safetensors", captures, prompt_token_ids)
    captures, prompt_token_ids = load_captures("captures.safetensors")
    replacer = TensorReplacer.from_files("captures.safetensors")        # the seeds' online mode

``captures`` is what :func:`~neuron_constrain.replacement.capture` returns and
:class:`~neuron_constrain.replacement.TensorReplacer` takes: one dict per prompt,
``{tap name: [step tensors]}`` (step 0 the prefill, then one per decode step), and
``prompt_token_ids`` one list of ints per prompt.

The file is one safetensors file. Step ``k`` of tap ``name`` of prompt ``i`` is the
tensor ``"{i}/{k}/{name}"``; the header's metadata entry ``neuron_constrain.captures``
is a JSON document with the structure, checked against the tensors on load::

    {"format": "neuron-constrain captures", "version": 1,
     "prompts": [{"token_ids": [1, 2, 3],
                  "taps": {"model.layers.0.mlp.router": {"dtype": "bfloat16", "shapes": [[1, 3, 8], [1, 4, 8]]}}}]}

Nothing is unpickled. The seeds' format (``torch.save(captures, "tensors.pt")`` and
``torch.save(prompt_ids, "prompt_token_ids.pt")``) is read only through
``torch.load(..., weights_only=True)``, after the zip checks of
:func:`neuron_constrain.loading.archive.check_zip`; a pickle that names anything but tensors
and containers is refused. Every refusal is a :class:`~neuron_constrain.loading.LoadError`
naming the file, the entry and the reason. This API (``save_captures``,
``load_captures``, ``TensorReplacer.from_files``) is what CLI commands that take
captures use; it is kept stable.
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Mapping, Sequence

import torch

from neuron_constrain.loading import LoadError
from neuron_constrain.loading.archive import check_zip
from neuron_constrain.loading.payloads import unpickling_reason

FORMAT = "neuron-constrain captures"
VERSION = 1
METADATA_KEY = "neuron_constrain.captures"

Captures = list[dict[str, list[torch.Tensor]]]


def save_captures(path: str | os.PathLike, captures: Sequence[Mapping[str, Sequence[torch.Tensor]]],
                  prompt_token_ids: Sequence[Sequence[int]]) -> None:
    """Write ``captures`` and ``prompt_token_ids`` to one safetensors file (no pickle).

    Args:
        path: the file, replaced atomically.
        captures: per prompt, tap name -> step tensors (:func:`capture`'s result).
        prompt_token_ids: the prompts, one per capture dict.

    Raises:
        ValueError: not one capture dict per prompt, a tap name that is not a module path, step
            tensors of mixed dtypes, or a file that cannot be written.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    prompts = [_token_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
    if len(captures) != len(prompts):
        raise ValueError(f"{len(captures)} captures but {len(prompts)} prompts: one capture dict per prompt")
    tensors: dict[str, torch.Tensor] = {}
    structure = []
    for i, (capture, tokens) in enumerate(zip(captures, prompts)):
        taps = {}
        for name, steps in capture.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"captures[{i}] has the tap name {name!r}; tap names are module paths (strings)")
            steps = list(steps)
            dtypes = {s.dtype for s in steps}
            if any(not isinstance(s, torch.Tensor) for s in steps) or len(dtypes) > 1:
                raise ValueError(f"captures[{i}][{name!r}] must be a list of tensors of one dtype")
            dtype = dtypes.pop() if dtypes else torch.float32
            taps[name] = {"dtype": _dtype_name(dtype), "shapes": [list(s.shape) for s in steps]}
            for k, step in enumerate(steps):
                tensors[f"{i}/{k}/{name}"] = step.detach().to("cpu", copy=True).contiguous()
        structure.append({"token_ids": tokens, "taps": taps})
    header = {"format": FORMAT, "version": VERSION, "prompts": structure}
    partial = f"{path}.partial"
    try:
        save_file(tensors, partial, metadata={METADATA_KEY: json.dumps(header)})
    except Exception as e:
        raise ValueError(f"cannot write captures to {path}: {e}") from e
    os.replace(partial, path)


def load_captures(path: str | os.PathLike, prompt_token_ids_path: str | os.PathLike | None = None
                  ) -> tuple[Captures, list[list[int]]]:
    """``(captures, prompt_token_ids)`` from a file :func:`save_captures` wrote.

    Also reads the seeds' ``torch.save`` pair (``tensors_path`` and
    ``prompt_token_ids_path``), through ``torch.load(weights_only=True)`` only.

    Args:
        path: a file :func:`save_captures` wrote (or the seeds' tensors file).
        prompt_token_ids_path: with the seeds' pair, the prompt ids file.

    Returns:
        ``(captures, prompt_token_ids)``.

    Raises:
        LoadError: no such file, not a captures file, or captures and prompts that do not match.
    """
    path = os.fspath(path)
    if _is_safetensors(path):
        if prompt_token_ids_path is not None:
            raise LoadError(path, "is a captures file that holds its prompt token ids; drop prompt_token_ids_path")
        return _load_safetensors(path)
    if prompt_token_ids_path is None:
        raise LoadError(path, "is not a captures file written by save_captures (safetensors); for the torch.save "
                              "format pass prompt_token_ids_path as well")
    captures = _seed_captures(path, _weights_only_load(path))
    ids_path = os.fspath(prompt_token_ids_path)
    prompts = _seed_prompts(ids_path, _weights_only_load(ids_path))
    if len(captures) != len(prompts):
        raise LoadError(path, f"holds captures of {len(captures)} prompts but {ids_path} has {len(prompts)} prompts")
    return captures, prompts


# ----------------------------------------------------------------------------- safetensors

def _is_safetensors(path: str) -> bool:
    if not os.path.isfile(path):
        raise LoadError(path, "no such file; check the path (captures written by save_captures)")
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < os.path.getsize(path)


def _load_safetensors(path: str) -> tuple[Captures, list[list[int]]]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            keys = set(f.keys())
            if METADATA_KEY not in metadata:
                raise LoadError(path, f"is a safetensors file without the {METADATA_KEY!r} metadata; write it with "
                                      "save_captures(path, captures, prompt_token_ids)")
            header = _header(path, metadata[METADATA_KEY])
            captures, prompts, seen = [], [], set()
            for i, prompt in enumerate(header["prompts"]):
                prompts.append(_token_ids(prompt.get("token_ids"), f"prompts[{i}].token_ids", path))
                taps = prompt.get("taps")
                if not isinstance(taps, dict):
                    raise LoadError(path, f"has prompts[{i}].taps that is not an object", METADATA_KEY)
                capture = {}
                for name, tap in taps.items():
                    if not isinstance(tap, dict) or not isinstance(tap.get("shapes"), list):
                        raise LoadError(path, f"describes tap {name!r} of prompt {i} without a shapes list", METADATA_KEY)
                    steps = []
                    for k, shape in enumerate(tap["shapes"]):
                        key = f"{i}/{k}/{name}"
                        if key not in keys:
                            raise LoadError(path, "is missing: the metadata lists it but the file has no such tensor", key)
                        tensor = f.get_tensor(key)
                        if list(tensor.shape) != shape or _dtype_name(tensor.dtype) != tap.get("dtype"):
                            raise LoadError(path, f"is {_dtype_name(tensor.dtype)}{list(tensor.shape)} but the metadata "
                                                  f"says {tap.get('dtype')}{shape}", key)
                        steps.append(tensor)
                        seen.add(key)
                    capture[name] = steps
                captures.append(capture)
            extra = sorted(keys - seen)
            if extra:
                raise LoadError(path, f"is a tensor the metadata does not describe ({len(extra)} such); refusing a file "
                                      "whose parts disagree", extra[0])
    except LoadError:
        raise
    except Exception as e:  # safetensors' own header and offset checks
        raise LoadError(path, f"is not a readable safetensors file ({_line(e)}); write it with save_captures") from e
    return captures, prompts


def _header(path: str, text: str) -> dict:
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise LoadError(path, f"has metadata that is not JSON ({_line(e)})", METADATA_KEY) from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise LoadError(path, f"has metadata that is not {FORMAT!r}", METADATA_KEY)
    if header.get("version") != VERSION:
        raise LoadError(path, f"is captures format version {header.get('version')!r}; this library reads {VERSION}",
                        METADATA_KEY)
    if not isinstance(header.get("prompts"), list):
        raise LoadError(path, "has no prompts list", METADATA_KEY)
    return header


# ----------------------------------------------------------------------------- the seeds' torch.save format

def _weights_only_load(path: str):
    check_zip(path, what="a torch.save file", fix="write captures with save_captures(path, captures, prompt_token_ids)")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise LoadError(path, f"holds objects a weights-only load refuses ({unpickling_reason(e)}); only tensors, "
                              "numbers and lists/dicts of them are read from torch.save files, nothing is unpickled "
                              "beyond that") from e
    except Exception as e:
        raise LoadError(path, f"is not a readable torch.save file ({_line(e)})") from e


def _seed_captures(path: str, value) -> Captures:
    if not isinstance(value, (list, tuple)):
        raise LoadError(path, f"holds a {type(value).__name__}, not a list of {{tap name: [step tensors]}} per prompt")
    captures = []
    for i, capture in enumerate(value):
        if not isinstance(capture, dict):
            raise LoadError(path, f"holds a {type(capture).__name__} for prompt {i}, not {{tap name: [step tensors]}}")
        steps_by_tap = {}
        for name, steps in capture.items():
            if isinstance(steps, torch.Tensor):
                steps = [steps]
            if not isinstance(name, str) or not isinstance(steps, (list, tuple)) or \
                    not all(isinstance(s, torch.Tensor) for s in steps):
                raise LoadError(path, f"holds prompt {i} tap {name!r} that is not a list of step tensors")
            steps_by_tap[name] = list(steps)
        captures.append(steps_by_tap)
    return captures


def _seed_prompts(path: str, value) -> list[list[int]]:
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() == 2 else [value.tolist()]
    if not isinstance(value, (list, tuple)):
        raise LoadError(path, f"holds a {type(value).__name__}, not one list of token ids per prompt")
    return [_token_ids(p.tolist() if isinstance(p, torch.Tensor) else p, f"prompt {i}", path) for i, p in enumerate(value)]


# ----------------------------------------------------------------------------- helpers

def _token_ids(value, what: str, path: str | None = None) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    ok = isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63
                                                   for t in value)
    if not ok:
        if path is None:
            raise ValueError(f"{what} must be a list of non-negative token ids")
        raise LoadError(path, f"has {what} that is not a list of non-negative token ids")
    return [int(t) for t in value]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
