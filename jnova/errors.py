"""The errors jnova raises, in one module every layer may import.

`CompileError`, `DeletedArgumentError`, `ParseError`, `UnsupportedPrimitiveError` and `VerifyError` are
part of the public API (`jnova.*`); bad options and arguments raise jax.jit's types (ValueError,
TypeError) instead."""
from __future__ import annotations


class CompileError(RuntimeError):
    """A compiler stage failed: names the stage, keeps the input it failed on and how to rerun it."""

    def __init__(self, stage: str, message: str, input_path: str | None = None, repro: str | None = None):
        self.stage = stage
        self.input_path = input_path
        self.repro = repro
        text = f"jnova: stage '{stage}' failed: {message.strip()}"
        if input_path:
            text += f"\n  input: {input_path}"
        if repro:
            text += f"\n  reproduce with: {repro}"
        super().__init__(text)


class UnsupportedPrimitiveError(NotImplementedError):
    """A primitive jnova cannot compile, under `fallback="error"`."""


class VerifyError(ValueError):
    """An op or function that breaks the rules of the nova dialect."""


class ParseError(ValueError):
    """Text that is not MLIR, or not a module of nova functions."""


class LoweringError(NotImplementedError):
    """A nova op (or a form of it) that a code generator does not handle."""


class DeletedArgumentError(ValueError):
    """A call passed an array whose buffer was deleted or donated to an earlier call (donate_argnums /
    donate_argnames); jax.jit raises a ValueError for it too."""
