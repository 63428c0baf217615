"""Errors jnova raises for failures inside the compiler (not for bad user input)."""
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
