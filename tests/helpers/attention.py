"""What the attention tests share: random inputs, a training step's comparison with jax.jit, and the
checks that the compiled step holds nova.attention / nova.attention_backward and no score-sized buffer."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jnova

TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}


def compare_with_jit(fn, *args, dtype="float32", reference=None, **jnova_options):
    """Compile `fn` with jnova and with jax.jit, run both on `args`, assert the results agree; returns the
    jnova step's Lowered (its stages and plan).

    In bf16 the two round differently (jnova's attention keeps scores and probabilities in f32, XLA
    rounds them to bf16), so an element may differ by more than bf16's tolerance. There each result must
    be at least as close to the f32 computation as jax.jit's is. That computation is `fn` on the inputs
    widened to f32, or `reference` (a function of the same arguments) where `fn` rounds to bf16 inside
    (a Flax module of dtype bf16 over f32 parameters): widening its inputs would not change it."""
    step = jnova.compile(fn, **jnova_options)
    got = step(*args)
    want = jax.jit(fn)(*args)
    leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves_got) == len(leaves_want)
    wide_results = None
    for i, (a, b) in enumerate(zip(leaves_got, leaves_want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        tol = TOLERANCE[dtype]
        scale = max(float(np.abs(b).max()), 1e-6)  # gradients of a sum: compare relative to the leaf's size
        if b.ndim == 0:  # a loss summing terms of size ~1 of both signs: its rounding is absolute, not relative
            scale = max(scale, 1.0)
        if dtype == "float32" or np.allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale):
            np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=f"result leaf #{i}")
            continue
        if wide_results is None:
            wide_results = _f32_results(fn, args, reference)
        r = wide_results[i]
        err_jnova, err_jit = np.linalg.norm(a - r), np.linalg.norm(b - r)
        assert err_jnova <= 1.5 * err_jit + 1e-3 * np.linalg.norm(r), (
            f"result leaf #{i}: jnova is {err_jnova:.3g} from the f32 result, jax.jit {err_jit:.3g}")
    return step.lower(*args)


def _f32_results(fn, args, reference):
    if reference is None:
        leaves = jax.tree.leaves(args)
        if not any(np.asarray(x).dtype == ml_dtypes.bfloat16 for x in leaves):
            raise ValueError("no argument is bf16, so widening them gives jax.jit's own bf16 computation: "
                             "pass reference=, the step computed in f32")
        wide = jax.tree.map(lambda x: np.asarray(x, np.float32) if np.asarray(x).dtype == ml_dtypes.bfloat16
                            else x, args)
        reference = fn
    else:
        wide = args
    return [np.asarray(r, np.float32) for r in jax.tree.leaves(jax.jit(reference)(*wide))]


def nova_op_names(lowered) -> list[str]:
    text = lowered.as_text("nova")
    return [line.split('"')[1] for line in text.splitlines() if '= "nova.' in line]


def assert_raised(lowered, backward=True):
    names = nova_op_names(lowered)
    assert "nova.attention" in names, names
    if backward:
        assert "nova.attention_backward" in names, names


def assert_no_score_buffer(lowered, score_elements: int):
    """Neither the nova function nor the plan holds a value of the scores' size (B * H * Tq * Tk)."""
    plan = lowered.executable.meta["plan"]
    for step in plan["steps"]:
        for shape, _ in step.get("out_types", []):
            assert int(np.prod(shape)) < score_elements, f"the plan holds a {shape} buffer: {step}"
    for line in lowered.as_text("nova").splitlines():
        if "->" not in line:
            continue
        results = line.rsplit("->", 1)[1]
        for dims in _tensor_dims(results):
            assert int(np.prod(dims)) < score_elements, f"a nova value of shape {dims}: {line.strip()[:200]}"


def _tensor_dims(text: str):
    for part in text.split("tensor<")[1:]:
        body = part.split(">")[0]
        yield [int(d) for d in body.split("x")[:-1]] or [1]


def addressed(view, base: np.ndarray) -> np.ndarray:
    """The elements of `base` (flat, row-major) that a `strided_views.StridedView` addresses, in the
    view's shape."""
    shape, flat = view.value.type.shape, base.reshape(-1)
    index = view.offset + sum(np.arange(n).reshape((-1,) + (1,) * (len(shape) - 1 - k)) * st
                              for k, (n, st) in enumerate(zip(shape, view.strides)))
    return flat[index]


def split_projection(qkv, heads: int, head_dim: int, offset: int = 0):
    """q, k, v of a fused projection [B, T, 3 H D]: as the GPT-2 example splits it (the gradient is a
    concatenation), or as slices starting `offset` elements into each row (pads and adds)."""
    b, t, _ = qkv.shape
    if not offset:
        return jnp.split(qkv.reshape(b, t, 3 * heads, head_dim), 3, axis=2)
    c = heads * head_dim
    return [qkv[..., offset + i * c:offset + (i + 1) * c].reshape(b, t, heads, head_dim) for i in range(3)]


def h200_plan(fn, *args, without=(), monkeypatch=None):
    """jnova's plan of `fn` for the H200 (built on the CPU), with the pipeline's passes named in
    `without` left out (their groups passed on unchanged). The kernels are compiled again each time:
    the in-process cache keys a step by its nova function, which those passes do not change."""
    from jnova import pipeline
    from jnova.runtime.cache import ARTIFACTS

    for name in without:
        monkeypatch.setattr(pipeline, name, lambda func, groups: groups)
    ARTIFACTS.clear()
    return jnova.compile(fn, target="h200").lower(*args)


def attention_kernel_params(lowered, kind: str) -> list[tuple[str, str]]:
    """(name, memref type) of each parameter of the plan's attention kernel of `kind` ("fwd", "dq",
    "dkdv")."""
    import re

    name = next(line.split()[0] for line in lowered.as_text("launches").splitlines() if f"attention[{kind} " in line)
    func = lowered.as_text("gpu").split(f"gpu.func @{name}(")[1].split(") kernel")[0]
    return re.findall(r"(%\w+): (memref<\w+>)", func)
