"""``TensorReplacer``: reference captures indexed by prompt and position, turned into
tap contexts for prefill, batched decode and speculative decode."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from neuron_constrain.core.errors import InputError
from neuron_constrain.replacement.files import load_captures
from neuron_constrain.core.tap_context import Entry


class TensorReplacer:
    """Reference captures indexed by prompt and position, turned into tap contexts.

    ``reference_captures[i][tap]`` is the list of step tensors of prompt ``i``: step 0
    (prefill) covers the prompt's positions, each later step contributes its last
    row (a full recompute or a one-token decode step alike). They are flattened to
    ``[positions, features]`` once, here.

    Args:
        reference_captures: per prompt, tap name -> step tensors (what :func:`capture` returns).
        prompt_token_ids: the prompts the captures were taken on, one per capture dict.

    Raises:
        InputError: not one capture dict per prompt, or step tensors that do not line up.
    """

    def __init__(self, reference_captures: Sequence[Mapping[str, Sequence[torch.Tensor]]], prompt_token_ids: Sequence[Sequence[int]]):
        if len(reference_captures) != len(prompt_token_ids):
            raise InputError(
                f"{len(reference_captures)} captures but {len(prompt_token_ids)} prompts: one capture dict per prompt"
            )
        self.prompts = [tuple(int(t) for t in p) for p in prompt_token_ids]
        self.taps = sorted({name for c in reference_captures for name in c})
        self.flat: list[dict[str, torch.Tensor]] = [
            {name: _flatten_steps(name, steps, len(prompt)) for name, steps in captures.items()}
            for captures, prompt in zip(reference_captures, self.prompts)
        ]
        self.features = {}
        for flat in self.flat:
            for name, rows in flat.items():
                if self.features.setdefault(name, rows.shape[1]) != rows.shape[1]:
                    raise InputError(f"tap {name!r} has {rows.shape[1]} features in one prompt and {self.features[name]} in another")
        self._by_length: dict[int, dict[int, list[int]]] = {}
        for index, prompt in enumerate(self.prompts):
            self._by_length.setdefault(len(prompt), {}).setdefault(hash(prompt), []).append(index)
        self._requests: dict[str, int] = {}

    def register_request(self, req_id: str, tokens: Sequence[int]) -> int:
        """Map ``req_id`` to the stored prompt that is the longest prefix of ``tokens``.

        Every stored length is tried (hash, then the tokens themselves are compared),
        so a request extending prompt 0 with generated tokens still maps to prompt 0.
        Known corner case: if those generated tokens happen to spell out a longer
        stored prompt, the longer prompt wins.

        Args:
            req_id: the request's id, as later passed to :meth:`build_context`.
            tokens: its tokens so far.

        Returns:
            The index of the prompt it maps to.

        Raises:
            InputError: no stored prompt is a prefix of ``tokens``.
        """
        tokens = tuple(int(t) for t in tokens)
        best, best_length = None, -1
        for length, by_hash in self._by_length.items():
            if length > len(tokens) or length <= best_length:
                continue
            prefix = tokens[:length]
            for index in by_hash.get(hash(prefix), ()):
                if self.prompts[index] == prefix:
                    best, best_length = index, length
                    break
        if best is None:
            raise InputError(
                f"request {req_id!r} ({len(tokens)} tokens) starts with none of the {len(self.prompts)} captured prompts"
            )
        self._requests[req_id] = best
        return best

    def prompt_index(self, req_id: str) -> int:
        """The stored prompt a request maps to.

        Args:
            req_id: a request :meth:`register_request` mapped.

        Returns:
            The prompt's index.

        Raises:
            InputError: the request was not registered.
        """
        if req_id not in self._requests:
            raise InputError(f"request {req_id!r} is not registered: call register_request(req_id, tokens) at its prefill")
        return self._requests[req_id]

    def build_context(
        self,
        req_ids: Sequence[str],
        positions: Sequence[int] | torch.Tensor,
        is_prefill: bool = False,
        tokens_per_req: int = 1,
        device: torch.device | str = "cpu",
    ) -> dict[str, Entry]:
        """Tap inputs for one forward pass over ``len(positions)`` token slots.

        Slot ``s`` belongs to request ``s // tokens_per_req`` (speculative decode:
        1 + drafts slots per request). A prefill with one request owns every slot
        and, as in the scheduler's layout, the first repeated position marks where
        padding starts. Slots past the requests, negative positions and positions
        past a capture are not enabled: the model keeps its own value there.

        Args:
            req_ids: the requests of the pass, registered with :meth:`register_request`.
            positions: each slot's position in its request.
            is_prefill: a prefill pass (one request may own every slot).
            tokens_per_req: slots per request (1 + draft tokens with speculative decoding).
            device: where the tap inputs go.

        Returns:
            Tap name -> ``(values, enabled)``: pass it to :func:`set_active_context`.

        Raises:
            InputError: an unregistered request, or ``tokens_per_req`` below 1.
        """
        positions = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
        if tokens_per_req < 1:
            raise InputError(f"tokens_per_req={tokens_per_req}: use 1 + the number of draft tokens")
        per_request = len(positions) if is_prefill and len(req_ids) == 1 else tokens_per_req
        prompts = [self.prompt_index(r) for r in req_ids]
        rows: list[tuple[int, int, int]] = []  # (slot, prompt, position)
        seen: dict[int, set[int]] = {}  # prefill: positions of each request so far
        padded: set[int] = set()        # prefill: requests whose padding has started
        for slot, position in enumerate(positions):
            request = slot // per_request
            if request >= len(req_ids) or position < 0 or request in padded:
                continue
            if is_prefill:
                if position in seen.setdefault(request, set()):
                    padded.add(request)
                    continue
                seen[request].add(position)
            rows.append((slot, prompts[request], position))
        context = {}
        for name in self.taps:
            values = torch.zeros(len(positions), self.features[name], dtype=self._dtype(name))
            enabled = torch.zeros(len(positions), dtype=torch.bool)
            for slot, prompt, position in rows:
                flat = self.flat[prompt].get(name)
                if flat is not None and position < flat.shape[0]:
                    values[slot] = flat[position]
                    enabled[slot] = True
            context[name] = (values.to(device), enabled.to(device))
        return context

    def warmup_context(self, num_tokens: int, device: torch.device | str = "cpu") -> dict[str, Entry]:
        """Zeros with every slot disabled: the shapes of a real context, nothing replaced.

        Args:
            num_tokens: token slots of the forward pass.
            device: where the tensors go.

        Returns:
            Tap name -> ``(values [num_tokens, features], enabled [num_tokens])``.
        """
        return {
            name: (torch.zeros(num_tokens, self.features[name], dtype=self._dtype(name), device=device),
                   torch.zeros(num_tokens, dtype=torch.bool, device=device))
            for name in self.taps
        }

    def _dtype(self, name: str) -> torch.dtype:
        return next(f[name].dtype for f in self.flat if name in f)

    @classmethod
    def from_files(cls, tensors_path, prompt_token_ids_path=None) -> "TensorReplacer":
        """A replacer from captures on disk (the seeds' online mode): see ``load_captures``. Nothing in
        either file is unpickled.

        Args:
            tensors_path: a file ``save_captures`` wrote (it holds the prompt ids too), or the seeds'
                ``torch.save`` captures, read with ``weights_only=True``.
            prompt_token_ids_path: with the seeds' pair, the prompts' file.

        Returns:
            The replacer.

        Raises:
            LoadError: no such file, not a captures file, or captures and prompts that do not match.
            InputError: captures that do not line up (as the constructor raises).
        """
        return cls(*load_captures(tensors_path, prompt_token_ids_path))


def _flatten_steps(name: str, steps: Sequence[torch.Tensor], prompt_length: int) -> torch.Tensor:
    if not steps:
        raise InputError(f"tap {name!r} has no captured steps")
    first = steps[0]
    if prompt_length == 0 or first.numel() % prompt_length:
        raise InputError(
            f"step 0 of tap {name!r} has shape {tuple(first.shape)}, which is not {prompt_length} prompt positions"
        )
    features = first.numel() // prompt_length
    rows = [first.reshape(prompt_length, features)]
    for step in steps[1:]:
        if step.numel() % features:
            raise InputError(f"a decode step of tap {name!r} has shape {tuple(step.shape)}, not rows of {features}")
        rows.append(step.reshape(-1, features)[-1:])
    return torch.cat(rows).detach()
