"""dce: remove ops whose results nobody reads (ops with side effects are kept)."""
from __future__ import annotations

import logging
from collections import Counter

from jnova.dialect.ir import Func, Op

log = logging.getLogger("jnova.passes")


def dce(func: Func, keep_sites: set[int] | None = None) -> int:
    """Delete dead ops in place; returns how many were removed.

    Pure ops die when unused. A `nova.fallback` (not pure) dies when unused only if its site is not
    in `keep_sites` (the sites whose JAX equation has effects); an impure op without a site is kept.
    """
    keep_sites = keep_sites or set()
    live = set(func.returns)
    kept, removed = [], Counter()
    for op in reversed(func.ops):
        if any(r in live for r in op.results) or _has_effects(op, keep_sites):
            kept.append(op)
            live.update(op.operands)
        else:
            removed[op.name] += 1
    func.ops = kept[::-1]
    total = sum(removed.values())
    if total:
        log.debug("dce: removed %d ops in func @%s: %s", total, func.name, dict(removed))
    return total


def _has_effects(op: Op, keep_sites: set[int]) -> bool:
    if op.pure:
        return False
    return "site" not in op.attrs or op.attrs["site"] in keep_sites
