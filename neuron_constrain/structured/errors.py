"""The structured runtime's errors. A request's own failure carries its ``request_id``.

| error | raised / recorded when |
| --- | --- |
| ``StructuredOutputsDisabledError`` | a constrained request reaches a model transformed without a mask |
| ``BatchLayoutError`` | the caller's batch names an unknown or repeated request, or needs too many rows |
| ``GrammarFailedError`` | a request's grammar failed to compile, or did not compile within its time limit |
| ``DisallowedTokenError`` | a request got a token its grammar forbids, or one past the vocabulary |
| ``GrammarFillError`` | a request's grammar fill raised, or did not return within the fill threads' limit |
| ``NoAllowedTokenError`` | a request's mask row allowed no token (a dead-end grammar, or min_tokens masking the only stop token) |

The last four are :class:`RequestFailedError`: they fail that request alone.
"""
from __future__ import annotations

from typing import Hashable

from neuron_constrain.core.errors import Error
from neuron_constrain.structured.constraints import ConstraintError


class StructuredOutputsDisabledError(Error, ValueError):
    """A constrained request reached a model transformed without a logit mask."""


class BatchLayoutError(Error, ValueError):
    """A batch layout names an unknown or repeated request, or needs more rows than the buffer has."""


class RequestFailedError(Error):
    """One request's failure: it names the request and fails it alone.

    Args:
        message: what went wrong, naming the request.
        request_id: the request (kept as ``request_id``).
    """

    def __init__(self, message: str, request_id: Hashable):
        super().__init__(message)
        self.request_id = request_id


class GrammarFailedError(RequestFailedError, ConstraintError):
    """A request's grammar failed to compile, or did not compile within its time limit."""


class DisallowedTokenError(RequestFailedError, ValueError):
    """A chosen token is not allowed by its request's grammar (or lies past the vocabulary).

    Args:
        message: what went wrong.
        request_id: the request (kept as ``request_id``).
        token: the token (kept as ``token``).
    """

    def __init__(self, message: str, request_id: Hashable, token: int):
        super().__init__(message, request_id)
        self.token = token


class GrammarFillError(RequestFailedError, RuntimeError):
    """A request's grammar fill raised, or did not return within the fill threads' time limit."""


class NoAllowedTokenError(RequestFailedError, ValueError):
    """A request's mask row allowed no token, so the token the model returned for it means nothing."""
