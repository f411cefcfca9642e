"""One request's processor parameters: what the host state turns into graph-input rows,
and what a custom processor's ``row()`` reads."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """One request's processor parameters (neutral defaults: the processor is off).

    ``stop_token_ids``: the ids ``min_tokens`` keeps masked (the state adds its
    ``eos_token_id``). ``extra``: values for custom processors' ``row()``.
    """

    min_tokens: int = 0
    stop_token_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
