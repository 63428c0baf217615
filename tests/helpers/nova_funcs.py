"""A step's nova function as the pipeline has it before the passes under test (traced, canonicalized,
common subexpressions merged, dead ops dropped)."""
from jnova.capture.to_nova import to_nova
from jnova.capture.trace import trace
from jnova.dialect.ir import Func
from jnova.passes.canonicalize import canonicalize
from jnova.passes.cse import cse
from jnova.passes.dce import dce


def nova_func(fn, *args) -> Func:
    func = to_nova(trace(fn, args, {}), fallback="error").func
    canonicalize(func)
    cse(func)
    dce(func)
    return func
