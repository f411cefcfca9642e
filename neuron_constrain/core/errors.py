"""Errors that name the problem and the fix, and :class:`Error`, the base of every
error the library raises on purpose (``except neuron_constrain.Error`` catches each; each
also keeps its builtin base, ``ValueError``, ``TimeoutError``..., where callers rely on it)."""

__all__ = ["EmptyMaskRowError", "Error", "InputError", "PassError", "TransformError"]


class Error(Exception):
    """Base of every error neuron-constrain raises on purpose."""


class TransformError(Error, ValueError):
    """A pass option or a model does not fit the graph (raised while transforming)."""


class PassError(TransformError):
    """A pass failed under the pass manager: it raised (the original error is the
    ``__cause__``), or the program broke a condition its contract names.

    Args:
        message: what went wrong ("while running mask_logits (after tap_modules): ...").
        pass_name: the pass (kept as ``pass_name``).
        after: the passes that ran before it (kept as ``after``).
    """

    def __init__(self, message: str, pass_name: str, after: list[str]):
        super().__init__(message)
        self.pass_name, self.after = pass_name, list(after)


class InputError(Error, ValueError):
    """A tensor fed to a transformed model has the wrong dtype, shape or device."""


class EmptyMaskRowError(Error, RuntimeError):
    """A logit mask row allows no token, so no token can be chosen for it.

    Args:
        rows: the rows (kept as ``rows``): indices, or index tuples for a mask with more dims.
        mask: the mask input (``"logit_mask"``, ``"logit_mask_1"``...), kept as ``mask``.
    """

    def __init__(self, rows, mask: str = "logit_mask"):
        self.rows = rows
        self.mask = mask
        super().__init__(
            f"{mask} allows no token in row(s) {rows}: the sampled token there would be meaningless. "
            "Check the grammar state of those requests (a finished grammar, or min_tokens masking the only "
            "allowed stop token), or transform with empty_row=<eos id> to emit that token instead"
        )
