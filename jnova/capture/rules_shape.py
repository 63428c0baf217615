"""Conversion rules for JAX primitives that move data without arithmetic."""
from __future__ import annotations

from jnova.capture.to_nova import out_type, rule


@rule("broadcast_in_dim")
def _broadcast_in_dim(b, eqn, x, *dyn):
    out = out_type(eqn)
    dims = tuple(int(d) for d in eqn.params["broadcast_dimensions"])
    if x.type.shape == out.shape and dims == tuple(range(out.rank)):
        return x
    return b.emit("nova.broadcast", [x], out, dims=dims)


@rule("reshape", "squeeze", "expand_dims")
def _reshape(b, eqn, x, *dyn):
    out = out_type(eqn)
    order = eqn.params.get("dimensions") if eqn.primitive.name == "reshape" else None
    if order is not None and tuple(order) != tuple(range(x.type.rank)):  # lax.reshape(dimensions=...): transpose first
        perm = tuple(int(d) for d in order)
        x = b.emit("nova.transpose", [x], x.type.with_shape([x.type.shape[d] for d in perm]), perm=perm)
    return x if out == x.type else b.emit("nova.reshape", [x], out)


@rule("transpose")
def _transpose(b, eqn, x):
    perm = tuple(int(p) for p in eqn.params["permutation"])
    return x if perm == tuple(range(len(perm))) else b.emit("nova.transpose", [x], out_type(eqn), perm=perm)


@rule("iota")
def _iota(b, eqn):
    return b.emit("nova.iota", [], out_type(eqn), dim=int(eqn.params["dimension"]))


@rule("empty", "empty2")
def _empty(b, eqn):
    """An array whose contents do not matter (the residual a branch not taken would read, in the
    gradient of `jnp.diagonal`): zeros, as JAX lowers it."""
    out = out_type(eqn)
    return b.broadcast_to(b.constant(0, out.dtype), out.shape)
