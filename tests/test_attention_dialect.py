"""nova.attention and nova.attention_backward as dialect ops: verifier messages naming the operand,
printing/parsing round trip, MLIR (IRDL) acceptance.

Oracles: the expected message fragments, the printed text itself, MLIR's parser.
"""
import pytest

from jnova.dialect.ir import Func, print_module
from jnova.errors import VerifyError
from jnova.dialect.irdl import verify_with_mlir
from jnova.dialect.ops import OPS
from jnova.dialect.ops_attention import attention_backward_op, attention_op
from jnova.dialect.parse import parse_module
from jnova.dialect.types import TensorType as T

B, TQ, HQ, HKV, D = 2, 8, 4, 2, 16


def _func(q, k, v, *extra_types, backward=False, **attrs):
    """A function holding one attention op (and its backward, if asked) over arguments of these types."""
    f = Func("f", [q, k, v, *extra_types])
    qv, kv, vv, *rest = f.args
    opts = {"causal": False, "scale": 0.25, "layout": "bthd", **attrs}
    optional = {}
    if rest:
        optional[opts.pop("optional", "bias")] = rest[0]
    else:
        opts.pop("optional", None)
    fwd = f.add(attention_op(qv, kv, vv, **opts, **optional))
    f.returns = list(fwd.results)
    if backward:
        bwd = f.add(attention_backward_op(qv, kv, vv, fwd.results[0], fwd.results[1], fwd.results[0], **opts,
                                          **optional))
        f.returns = list(bwd.results)
    return f


def _error(f) -> str:
    with pytest.raises(VerifyError) as e:
        f.verify()
    return str(e.value)


Q = T((B, TQ, HQ, D), "float32")
KV = T((B, TQ, HKV, D), "float32")


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("optional", [None, "bias", "mask"])
def test_round_trip_and_mlir_accept(layout, optional):
    q, kv = (Q, KV) if layout == "bthd" else (T((B, HQ, TQ, D), "bfloat16"), T((B, HKV, TQ, D), "bfloat16"))
    extra = []
    if optional == "bias":
        extra = [T((1, HQ, TQ, TQ), "float32")]
    elif optional == "mask":
        extra = [T((B, 1, TQ, TQ), "bool")]
    f = _func(q, kv, kv, *extra, backward=True, layout=layout, causal=optional is None,
              **({"optional": optional} if optional else {}))
    f.verify()
    text = print_module([f])
    verify_with_mlir(text)
    g = parse_module(text)
    assert g.print() == f.print()
    fwd, bwd = g.ops
    assert fwd.name == "nova.attention" and bwd.name == "nova.attention_backward"
    assert fwd.attrs["layout"] == layout and fwd.attrs["optional_operand"] == (optional or "none")
    assert fwd.results[1].type == T((B, HQ, TQ), "float32")
    assert [r.type for r in bwd.results] == [q, kv, kv]
    assert fwd.dims() == {"B": B, "Hq": HQ, "Hkv": HKV, "Tq": TQ, "Tk": TQ, "D": D}


def test_ops_are_registered():
    assert "nova.attention" in OPS and "nova.attention_backward" in OPS


@pytest.mark.parametrize("build, expect", [
    (lambda: _func(T((B, TQ, HQ), "float32"), KV, KV), ["operand 'q'", "expected a rank-4 tensor", "[B, T, H, D]"]),
    (lambda: _func(T((B, TQ, HQ, D), "float64"), KV, KV), ["operand 'q'", "element type float64", "expected one of"]),
    (lambda: _func(Q, KV.with_dtype("bfloat16"), KV), ["operand 'k'", "element type bfloat16", "like operand 'q'"]),
    (lambda: _func(Q, KV, T((B, TQ + 1, HKV, D), "float32")), ["operand 'v'", "expected (2, 8, 2, 16) like operand 'k'"]),
    (lambda: _func(Q, T((B, TQ, HKV, 32), "float32"), T((B, TQ, HKV, 32), "float32")),
     ["operand 'k'", "head dim 32", "expected 16 like operand 'q'"]),
    (lambda: _func(Q, T((B, TQ, 3, D), "float32"), T((B, TQ, 3, D), "float32")),
     ["operand 'k'", "3 heads", "divisor of the 4 heads of operand 'q'"]),
    (lambda: _func(Q, T((B + 1, TQ, HKV, D), "float32"), T((B + 1, TQ, HKV, D), "float32")),
     ["operand 'k'", "batch size 3", "expected 2"]),
    (lambda: _func(Q, T((B, TQ * 2, HKV, D), "float32"), T((B, TQ * 2, HKV, D), "float32"), causal=True),
     ["causal attention needs as many queries as keys", "operand 'q' has 8", "operand 'k' 16"]),
    (lambda: _func(Q, KV, KV, layout="thbd"), ["attribute 'layout' = 'thbd'", "expected one of"]),
    (lambda: _func(Q, KV, KV, T((B, HQ, TQ, 3), "float32")),
     ["operand 'bias'", "shape (2, 4, 8, 3)", "[B, Hq, Tq, Tk]", "[2, 4, 8, 8]"]),
    (lambda: _func(Q, KV, KV, T((B, TQ, TQ), "float32")), ["operand 'bias'", "expected 4 dimensions"]),
    (lambda: _func(Q, KV, KV, T((B, HQ, TQ, TQ), "int32")), ["operand 'bias'", "element type int32"]),
    (lambda: _func(Q, KV, KV, T((B, HQ, TQ, TQ), "float32"), optional="mask"),
     ["operand 'mask'", "element type float32", "expected bool"]),
    (lambda: _func(Q, KV, KV, scale=float("nan")), ["attribute 'scale'", "expected a finite float"]),
])
def test_verifier_names_the_operand(build, expect):
    message = _error(build())
    assert "'nova.attention' op" in message
    for fragment in expect:
        assert fragment in message, message


def test_backward_verifier_names_its_operands():
    f = _func(Q, KV, KV, backward=True)
    fwd, bwd = f.ops
    bwd.operands[4] = fwd.results[0]  # o where lse belongs
    assert "operand 'lse' has type tensor<2x8x4x16xf32>, expected tensor<2x4x8xf32>" in _error(f)
    f = _func(Q, KV, KV, backward=True)
    f.ops[1].results[1].type = Q
    assert "result 'dk' has type tensor<2x8x4x16xf32>, expected tensor<2x8x2x16xf32>" in _error(f)


def test_optional_operand_count_is_checked():
    f = _func(Q, KV, KV, T((B, HQ, TQ, TQ), "float32"))
    f.ops[0].attrs["optional_operand"] = "none"
    assert "attribute 'optional_operand' = 'none', so expected 0 operands 'extra', got 1" in _error(f)


def test_result_types_are_checked():
    f = _func(Q, KV, KV)
    f.ops[0].results[1].type = T((B, TQ, HQ), "float32")
    assert "result 'lse' has type tensor<2x8x4xf32>, expected tensor<2x4x8xf32>" in _error(f)
