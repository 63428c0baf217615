"""jnova: compile JAX training steps into fused kernels (the Nova JIT compiler for JAX)."""
__version__ = "0.1.0"

from jnova.api import CompiledStep, Lowered, compile  # noqa: E402
from jnova.capture.to_nova import UnsupportedPrimitiveError  # noqa: E402
from jnova.dialect.ir import VerifyError  # noqa: E402
from jnova.runtime.disk_cache import enable_xla_cache  # noqa: E402

__all__ = ["compile", "CompiledStep", "Lowered", "UnsupportedPrimitiveError", "VerifyError", "enable_xla_cache",
           "__version__"]
