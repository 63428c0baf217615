"""jnova: compile JAX training steps into fused kernels (the Nova JIT compiler for JAX)."""
from jnova.version import __version__  # noqa: E402

from jnova.api import CompiledStep, Lowered, compile  # noqa: E402
from jnova import ops  # noqa: E402
from jnova.errors import (CompileError, DeletedArgumentError, ParseError, UnsupportedPrimitiveError,  # noqa: E402
                          VerifyError)
from jnova.runtime.disk_cache import enable_xla_cache  # noqa: E402

__all__ = ["compile", "CompiledStep", "Lowered", "CompileError", "DeletedArgumentError", "ParseError",
           "UnsupportedPrimitiveError", "VerifyError", "enable_xla_cache", "ops", "__version__"]
