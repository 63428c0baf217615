"""dce: remove ops whose results nobody reads (fallback ops with side effects are kept)."""
from __future__ import annotations

from jnova.dialect.ir import Func


def dce(func: Func, keep_sites: set[int] | None = None) -> int:
    """Delete dead ops in place; returns how many were removed.

    Pure ops die when unused; a `nova.fallback` dies only if its site is not in `keep_sites`
    (the sites whose JAX equation has effects).
    """
    keep_sites = keep_sites or set()
    live = set(func.returns)
    kept = []
    for op in reversed(func.ops):
        needed = any(r in live for r in op.results)
        if not needed and not op.pure and op.attrs.get("site") in keep_sites:
            needed = True
        if needed:
            kept.append(op)
            live.update(op.operands)
    removed = len(func.ops) - len(kept)
    func.ops = kept[::-1]
    return removed
