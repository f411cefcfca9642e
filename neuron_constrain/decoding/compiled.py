"""The decode programs compiled ahead of time: AOTInductor packages, or the programs on the XLA device.

    decoder = export_decoder(model, max_batch=8, max_len=1024, vocab_size=V, compile="inductor")
    decoder = compile_decoder(eager, "inductor")   # the same, from a decoder already exported
    decoder = compile_decoder(eager, "xla")        # torch-xla: the lowering torch-neuronx compiles

``"inductor"``: every program (the prefill and each step) becomes one AOTInductor package
(``torch._inductor.aoti_compile_and_package``) compiled once for all its dynamic shapes
(batch, prefill length, attention window): no shape compiles again, and a later export of
the same graph and weights loads its package from the cache folder (keyed by the graph,
its signature, a digest of the weights, the torch version, the torch threads). The weights
are frozen into the package (Inductor's ``freezing``, which runs only with autograd off:
each linear layer's weight prepacked for oneDNN, for the whole dynamic batch): a SmolLM2
step on this CPU reads its weights at about the machine's memory bandwidth, where MKL's
fp32 GEMM, eager's and Hugging Face's, takes twice as long at one row and four times as
long at eight (docs/guides/real-model.md, "Compiled programs"). The KV cache is
not in the package: it is loaded into every package as a *user-managed constant*,
the very tensors the eager programs hold, so all of them read and write the one cache
(``keep_rows`` moves its rows for all) and the eager programs stay the reference,
runnable side by side. A package runs in plain torch, without this library::

    step = torch._inductor.aoti_load_package("step.pt2")
    step.load_constants(torch.load("cache.pt"), check_full_update=False)  # CachedDecoder.save_cache
    tokens, empty_rows = step(input_ids, position_ids, attention_mask, logit_mask=mask)

``"xla"``: every program is copied to the XLA device (``decoding.xla.to_xla``) over one
cache there; the host sends each step's inputs (tokens, positions, the mask, noise) as
device data, so one HLO graph is compiled per program and (batch, length or window)
bucket, and none after a warm-up over those buckets.

Only the program runs compiled: the host code around it (feeding the added inputs,
checking a mask's shape, reading the empty-row flags) is ``Transformed``'s own.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import pathlib
import tempfile
import time

import torch

__all__ = ["BACKENDS", "cache_names", "compile_decoder", "package_cache_dir", "share_cache", "weights_digest"]

BACKENDS = ("inductor", "xla")
AUTO = "auto"  # "inductor" where every package is already built, else the eager decoder as it is


def share_cache(programs, prefix: str = "cache.") -> list[torch.Tensor]:
    """Make every program read and write the first one's cache tensors: in its state dict
    (what split halves and ``program.module()`` take) and in its callable module.

    Args:
        programs: ``Transformed`` programs over caches of one layout (the prefill and the steps).
        prefix: the state-dict names of the cache tensors start with it.

    Returns:
        The shared tensors, ordered by layer (``keys_0``, ``values_0``, ``keys_1``...).

    Raises:
        RuntimeError: a cache tensor's shape differs between two programs.
    """
    first = programs[0].program.state_dict
    names = sorted((n for n in first if n.startswith(prefix)), key=lambda n: (int(n.rsplit("_", 1)[1]), n))
    for transformed in programs:
        state = transformed.program.state_dict
        for name in names:
            if tuple(state[name].shape) != tuple(first[name].shape):
                raise RuntimeError(f"{name}: {tuple(state[name].shape)} in one program, {tuple(first[name].shape)} in another")
            state[name] = first[name]
            owner, _, leaf = name.rpartition(".")
            transformed.graph_module.get_submodule(owner).register_buffer(leaf, first[name])
    return [first[n] for n in names]


def package_cache_dir(folder=None) -> pathlib.Path:
    """Where AOTInductor packages are kept.

    Args:
        folder: the folder to use, if given.

    Returns:
        ``folder``, else ``$NEURON_CONSTRAIN_PACKAGES``, else a ``neuron_constrain`` folder in Inductor's own
        cache (``$TORCHINDUCTOR_CACHE_DIR``).
    """
    if folder is not None:
        return pathlib.Path(folder)
    if os.environ.get("NEURON_CONSTRAIN_PACKAGES"):
        return pathlib.Path(os.environ["NEURON_CONSTRAIN_PACKAGES"])
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / "neuron_constrain"


class _Runner(torch.nn.Module):
    """A compiled callable where ``Transformed`` keeps its graph module."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)


def _running(transformed, runner: torch.nn.Module):
    """A copy of ``transformed`` that calls ``runner`` instead of its graph module (the
    program, report and host-side checks are shared, not copied)."""
    twin = copy.copy(transformed)
    twin.__dict__["_modules"] = dict(transformed._modules)
    twin.graph_module = runner
    return twin


def weights_digest(program, cache: list[torch.Tensor]) -> str:
    """A digest of every constant of a program but the cache (whose values change): the weights a package
    holds, part of its key beside the graph.

    Args:
        program: the program (``ExportedProgram``).
        cache: the cache tensors, left out.

    Returns:
        The digest, hex (each constant's name, shape, dtype and bytes).
    """
    skip = {id(t) for t in cache}
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(_constants(program).items()):
        if id(tensor) in skip:
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _graph_text(module: torch.fx.GraphModule) -> str:
    """Every node (nested graphs too) with its value's type and shape, and no source
    locations: editing the file a model's ``forward`` lives in changes no key."""
    lines = []
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                value = node.meta.get("val")
                shape = (f"{value.dtype}{tuple(value.shape)}{value.stride()}{value.device}"
                         if isinstance(value, torch.Tensor) else repr(value))
                lines.append(f"{node.format_node()} :: {shape}")
    return "\n".join(lines)


def _graph_key(program, weights: str) -> str:
    """What an AOTInductor package depends on: the graph, its signature and shape ranges,
    the weights, the torch version, and the threads its kernels were generated for (Inductor
    writes ``torch.get_num_threads()`` into each parallel loop)."""
    text = "\n".join([
        weights, f"threads={torch.get_num_threads()}", torch.__version__, _graph_text(program.graph_module),
        str(program.graph_signature),
        str(sorted((str(k), str(v)) for k, v in program.range_constraints.items())),
        str(program.call_spec.in_spec), str(program.call_spec.out_spec),
    ])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# Weights frozen in. Inductor's indirect-index asserts off: torch 2.9's Inductor writes one before the
# value it checks in a one-row llama prefill (a C++ compile error); CachedDecoder checks every index
# its programs take (token ids, positions, rows) on the host instead. Part of every package's key.
INDUCTOR_CONFIGS = {"freezing": True, "assert_indirect_indexing": False}


def _constants(program) -> dict[str, torch.Tensor]:
    return {**program.state_dict, **{k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)}}


def _package_path(program, weights: str, folder: pathlib.Path) -> pathlib.Path:
    return folder / f"{_graph_key(program, weights + repr(INDUCTOR_CONFIGS))}.pt2"


def _package(program, path: pathlib.Path, log) -> bool:
    """Compile ``program`` into ``path`` unless it is there: whether it compiled now."""
    from torch._inductor import aoti_compile_and_package, config as inductor_config

    if path.is_file():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # written whole, then moved: no torn package; Inductor freezes only with autograd off (silently).
    # Inductor's own files for the package (a shared library holding the frozen weights: 750 MB for
    # SmolLM2) go to the scratch folder too, not to its cache, where they were kept under a fresh key
    # every build and never read again (1.8 GB a test run).
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch, torch.no_grad(), \
            inductor_config.patch({"aot_inductor.output_path": scratch}):
        built = aoti_compile_and_package(
            program, package_path=os.path.join(scratch, "program.pt2"), inductor_configs=dict(INDUCTOR_CONFIGS),
        )
        os.replace(built, path)
    log(f"compiled {path.name} in {time.perf_counter() - start:.1f} s")
    return True


def cache_names(program, cache: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The cache tensors by their names in a program (the names a package's constants have).

    Args:
        program: the program (``ExportedProgram``).
        cache: the cache tensors.

    Returns:
        State-dict name -> tensor, for the program's entries that are cache tensors.
    """
    ids = {id(t) for t in cache}
    return {name: t for name, t in program.state_dict.items() if id(t) in ids}


def _load(path: pathlib.Path, program, cache: list[torch.Tensor]):
    from torch._inductor import aoti_load_package

    compiled = aoti_load_package(str(path))
    shared = cache_names(program, cache)
    missing = sorted(set(shared) - set(compiled.get_constant_fqns()))
    if missing:  # it would write a cache of its own: every step would read stale keys
        raise RuntimeError(f"the package {path} does not take the KV cache as a constant ({missing[:3]}); "
                           "delete it (a stale cache entry) and compile again")
    # user-managed: the package reads and writes these very tensors (the one shared cache)
    compiled.load_constants(shared, check_full_update=False, user_managed=True)
    return compiled


def _programs(decoder) -> dict:
    """The decoder's programs by name: ``"prefill"``, ``"step1"``, ``"step4"``..."""
    return {"prefill": decoder.prefill, **{f"step{n}": s for n, s in decoder.steps.items()}}


def _inductor(decoder, cache_dir, log, build: bool):
    """The programs loaded from their packages, compiling the missing ones (``build``) or
    returning None when one is missing (not ``build``: ``"auto"``)."""
    folder = package_cache_dir(cache_dir)
    programs = _programs(decoder)
    weights = weights_digest(decoder.prefill.program, decoder.cache)  # every program holds the same weights
    packages = {name: _package_path(t.program, weights, folder) for name, t in programs.items()}
    if not build and not all(path.is_file() for path in packages.values()):
        return None
    built = 0
    for name, transformed in programs.items():
        for tensor in _constants(transformed.program).values():
            if tensor.device.type != "cpu":
                raise ValueError(f"{name}: AOTInductor here compiles for the CPU, but a weight is on {tensor.device}")
        built += _package(transformed.program, packages[name], log)
    compiled = {name: _running(programs[name], _Runner(_load(path, programs[name].program, decoder.cache)))
                for name, path in packages.items()}
    return compiled, packages, built


def _xla(decoder):
    from neuron_constrain.decoding.xla import to_xla, xla_device

    device = xla_device()
    moved = {name: to_xla(t, device) for name, t in _programs(decoder).items()}
    cache = share_cache(list(moved.values()))
    return moved, cache, device


def compile_decoder(decoder, backend: str = "inductor", *, cache_dir=None, log=None):
    """A :class:`~neuron_constrain.decoding.CachedDecoder` whose programs run compiled
    (``backend``: ``"inductor"``, AOTInductor packages on the CPU; ``"xla"``, the programs
    on the XLA device; ``"auto"``, the packages where every one is built already, else
    ``decoder`` itself, eager, with nothing compiled). ``decoder`` is left as it was; with
    ``"inductor"`` both share one KV cache (the compiled one is a faster view of the same
    programs).

    Args:
        decoder: an eager decoder from :func:`export_decoder`.
        backend: ``"inductor"``, ``"xla"`` or ``"auto"``.
        cache_dir: where packages are kept, keyed by the graph, its signature, a digest of the
            weights and the torch version (the next export of the same model loads them).
        log: a function given progress lines (compiling, loading).

    Returns:
        The compiled decoder (or, for ``"auto"`` with a package missing, ``decoder``).

    Raises:
        TypeError: not a decoder from :func:`export_decoder`.
        ValueError: a decoder already compiled, an unknown backend, weights not on the CPU for
            ``"inductor"``."""
    if not (dataclasses.is_dataclass(decoder) and hasattr(decoder, "steps") and hasattr(decoder, "prefill")):
        raise TypeError(f"compile_decoder takes a CachedDecoder (export_decoder's), not {type(decoder).__name__}")
    if decoder.compiled is not None:
        raise ValueError(f"this decoder is already compiled ({decoder.compiled}); compile the eager one")
    log = log or (lambda message: None)
    start = time.perf_counter()
    if backend in ("inductor", AUTO):
        found = _inductor(decoder, cache_dir, log, build=backend == "inductor")
        if found is None:  # "auto" and a package missing: no first compile of minutes
            return decoder
        programs, packages, built = found
        backend, fields = "inductor", dict(cache=decoder.cache, packages=packages, packages_built=built)
    elif backend == "xla":
        programs, cache, device = _xla(decoder)
        fields = dict(cache=cache, device=device)
    else:
        raise ValueError(f"compile={backend!r}: choose one of {', '.join((*BACKENDS, AUTO))} (or None: run the programs eagerly)")
    steps = {int(name[len("step"):]): program for name, program in programs.items() if name != "prefill"}
    return dataclasses.replace(decoder, prefill=programs["prefill"], steps=steps, compiled=backend,
                               compile_seconds=time.perf_counter() - start, eager=decoder, **fields)
