"""jnova.compile keeps jax.jit's contract: static and donated arguments, option checks at compile
time, errors and warnings that name the user's code. Each test runs jax.jit on the same input and
compares (results, exception types, what the message names)."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core
from jax.interpreters import mlir

import jnova
from helpers.random_inputs import rand
from models import assert_trees_close, fresh_seed


def _normal(*shape, seed=None):
    return rand(shape, jnp.float32, fresh_seed() if seed is None else seed)


def _raised(thunk) -> BaseException:
    try:
        thunk()
    except Exception as e:  # noqa: BLE001 - the test compares what was raised
        return e
    raise AssertionError("expected an exception")


# --------------------------------------------------------------------------- static arguments
def scaled_power(x, power, *, mode="tanh"):
    y = x ** power
    return jnp.tanh(y) if mode == "tanh" else jnp.sin(y)


def test_static_argnums_and_argnames_like_jit():
    """Static values are passed to the function as Python values (the program branches on them), are
    part of the cache key (a new value compiles again, the same one does not), and may be passed by
    position or by name."""
    x = _normal(16)
    step = jnova.compile(scaled_power, static_argnums=1, static_argnames="mode")
    want = jax.jit(scaled_power, static_argnums=1, static_argnames="mode")
    for power, mode in [(2, "tanh"), (3, "tanh"), (3, "sin"), (2, "tanh")]:
        assert_trees_close(step(x, power, mode=mode), want(x, power, mode=mode))
    assert step.compile_count == 3, "the same static values compiled again, or new ones did not"
    assert_trees_close(step(x, power=3, mode="sin"), want(x, power=3, mode="sin"))  # static by name
    assert_trees_close(step(x + 1, 3, mode="sin"), want(x + 1, 3, mode="sin"))  # a new array: no compile
    assert step.compile_count == 4
    assert_trees_close(step(x, 2.0), want(x, 2.0))  # 2.0 is not 2 (jax.jit keys statics by type too)
    assert step.compile_count == 5
    compiled = step.lower(x, 2, mode="sin").compile()  # as jax.jit's compiled objects: dynamic arguments only
    assert_trees_close(compiled(x), want.lower(x, 2, mode="sin").compile()(x))


def test_static_argnames_infers_the_position_like_jit():
    x = _normal(8)
    step = jnova.compile(scaled_power, static_argnames=("power", "mode"))
    want = jax.jit(scaled_power, static_argnames=("power", "mode"))
    assert step.arguments.static_argnums == (1,) and step.arguments.static_argnames == ("power", "mode")
    assert_trees_close(step(x, 4), want(x, 4))


def test_unhashable_static_argument_is_jits_error():
    x = _normal(8)
    want = _raised(lambda: jax.jit(scaled_power, static_argnums=1)(x, [2]))
    got = _raised(lambda: jnova.compile(scaled_power, static_argnums=1)(x, [2]))
    assert type(got) is type(want) is ValueError
    assert "Non-hashable static arguments" in str(want) and "Non-hashable static arguments" in str(got)
    assert "scaled_power" in str(got) and "list" in str(got)
    array = _raised(lambda: jnova.compile(scaled_power, static_argnames="mode")(x, 2, mode=x))
    assert type(array) is type(_raised(lambda: jax.jit(scaled_power, static_argnames="mode")(x, 2, mode=x)))


def test_non_array_argument_names_function_and_path_like_jit():
    """A string passed as an ordinary argument: jax.jit's TypeError type, naming the argument's path
    and the options that exist to pass it (static_argnums / static_argnames)."""
    def update(params, config):
        return jax.tree.map(lambda p: p * 2, params)

    params = {"w": _normal(4), "b": _normal(2)}
    want = _raised(lambda: jax.jit(update)(params, {"opt": "adam"}))
    got = _raised(lambda: jnova.compile(update)(params, {"opt": "adam"}))
    assert type(got) is type(want) is TypeError
    assert "config['opt']" in str(got) and "update" in str(got) and "str" in str(got)
    assert "static_argnums" in str(got) and "static_argnames" in str(got)
    assert_trees_close(jnova.compile(update, static_argnums=1)(params, ("adam",)),
                       jax.jit(update, static_argnums=1)(params, ("adam",)))
    def scale(lr, params, name):
        return jax.tree.map(lambda p: p * lr, params)

    got = _raised(lambda: jnova.compile(scale, static_argnums=0)(2.0, params, "sgd"))
    assert type(got) is type(_raised(lambda: jax.jit(scale, static_argnums=0)(2.0, params, "sgd"))) is TypeError
    assert "argument name of scale" in str(got), got  # named by its position among all the arguments


# --------------------------------------------------------------------------- options checked at compile()
def four_arguments(a, b, c, d):
    return a * b + c - d


@pytest.mark.parametrize("options", [
    {"donate_argnums": (7,)},
    {"static_argnums": (7,)},
    {"static_argnames": "zz"},
    {"donate_argnames": "zz"},
    {"static_argnums": 1, "donate_argnums": 1},
    {"static_argnames": "b", "donate_argnames": "b"},
    {"static_argnums": "b"},
    {"donate_argnums": 1.5},
])
def test_argument_options_are_checked_at_compile_like_jit(options):
    """The checks jax.jit makes when it wraps a function, made by jnova.compile (not at the first
    call), with jax.jit's exception type."""
    want = _raised(lambda: jax.jit(four_arguments, **options))
    got = _raised(lambda: jnova.compile(four_arguments, **options))
    assert type(got) is type(want), (got, want)
    assert str(got) == str(want)


def test_target_is_checked_at_compile():
    """An unknown GPU name is a ValueError from jnova.compile naming the presets, before any call."""
    with pytest.raises(ValueError, match=r"unknown target 'a100'; presets: .*h200"):
        jnova.compile(four_arguments, target="a100")
    with pytest.raises(TypeError, match="target must be None, a preset name or a Target"):
        jnova.compile(four_arguments, target=100)
    with pytest.raises(ValueError, match="needs backend=None or 'gpu'"):
        jnova.compile(four_arguments, target="h200", backend="cpu")


# --------------------------------------------------------------------------- donation
def momentum_update(params, velocity, grads):
    velocity = jax.tree.map(lambda v, g: 0.9 * v + g, velocity, grads)
    return jax.tree.map(lambda p, v: p - 0.1 * v, params, velocity), velocity


def _tree(seed):
    return {"w": _normal(8, 4, seed=seed), "b": _normal(4, seed=seed + 1)}


@pytest.mark.parametrize("by_keyword", [False, True])
def test_donate_argnames_like_jit(by_keyword):
    """donate_argnames consumes the same buffers as under jax.jit, passed by name or by position."""
    seed = fresh_seed()
    results, deleted = [], []
    for make in (jax.jit, jnova.compile):
        step = make(momentum_update, donate_argnames=("params", "velocity"))
        args = [_tree(seed), _tree(seed + 10), _tree(seed + 20)]
        if by_keyword:
            results.append(step(params=args[0], velocity=args[1], grads=args[2]))
        else:
            results.append(step(*args))
        deleted.append([leaf.is_deleted() for leaf in jax.tree.leaves(args)])
    assert_trees_close(results[1], results[0])
    assert deleted[1] == deleted[0] and any(deleted[0]), deleted


def test_reusing_a_donated_argument_raises_a_public_error_like_jit():
    seed = fresh_seed()
    errors = []
    for make in (jax.jit, jnova.compile):
        step = make(momentum_update, donate_argnums=(0, 1))
        args = (_tree(seed), _tree(seed + 1), _tree(seed + 2))
        step(*args)
        errors.append(_raised(lambda: step(*args)))
    assert isinstance(errors[1], type(errors[0])) and isinstance(errors[0], ValueError)
    assert isinstance(errors[1], jnova.DeletedArgumentError) and type(errors[1]).__module__ == "jnova.errors"
    assert "donate" in str(errors[1])


def test_static_and_donated_arguments_together():
    """Donation positions count the static arguments, as jax.jit's do."""
    def step(lr, params, grads):
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    seed = fresh_seed()
    out = []
    for make in (jax.jit, jnova.compile):
        f = make(step, static_argnums=0, donate_argnums=1)
        params, grads = _tree(seed), _tree(seed + 1)
        out.append((f(0.5, params, grads), [p.is_deleted() for p in jax.tree.leaves(params)],
                    [g.is_deleted() for g in jax.tree.leaves(grads)]))
    assert_trees_close(out[1][0], out[0][0])
    assert out[1][1:] == out[0][1:] and all(out[0][1])


# --------------------------------------------------------------------------- errors name the user's code
def loss_with_python_branch(params, batch):
    if params["layer"]["w"].sum() > 0:  # a Python branch on a traced value: a tracing error
        return jnp.sum(batch["x"] @ params["layer"]["w"])
    return jnp.sum(batch["x"])


@pytest.mark.parametrize("kernels", ["auto", "fused"])
def test_weakly_typed_results_like_jit(kernels):
    """A result jax.jit returns weakly typed (a step count passed in as a Python int, a learning rate
    computed from it, a Python float) is weakly typed from jnova too: it promotes the same way and, fed
    back into the step, has the signature of the first call."""
    def step(w, count, lr):
        loss, grad = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(w) ** 2))(w)
        return w - lr * grad, count + 1, lr * 0.5, 3.0, loss

    w = _normal(3, 4)
    want = jax.jit(step)(w, 0, 0.1)
    compiled = jnova.compile(step, kernels=kernels)
    got = compiled(w, 0, 0.1)
    assert [x.weak_type for x in got] == [x.weak_type for x in want] == [False, True, True, True, False]
    assert_trees_close(got, want)
    compiled(got[0], got[1], got[2])
    assert compiled.compile_count == 1


def test_tracing_error_names_the_users_function_and_argument_path_like_jit():
    params, batch = {"layer": {"w": _normal(4, 3)}}, {"x": _normal(2, 4)}
    want = _raised(lambda: jax.jit(loss_with_python_branch)(params, batch))
    got = _raised(lambda: jnova.compile(loss_with_python_branch)(params, batch))
    assert type(got) is type(want)
    message = str(got)
    assert "loss_with_python_branch" in message and "params['layer']['w']" in message, message
    assert "flat_fn" not in message and "trace.py" not in message and "flat[" not in message, message


def train_step(params, scale, x, *, mode="tanh"):
    y = x @ params["w"] * scale
    return jnp.tanh(y).sum() if mode == "tanh" else jnp.sin(y).sum()


def test_errors_from_the_compiled_steps_dispatch_name_the_users_arguments_like_jit():
    """Errors jax raises while dispatching the compiled step (an AOT-compiled call with other shapes, a
    Python int beyond int32) name the user's function and argument (`x`, `train_step`), as jax.jit's,
    not jnova's wrapper (`args[1]`, `step`), static arguments left out as jax.jit leaves them out."""
    params, x = {"w": _normal(4, 3)}, _normal(2, 4)
    for compile_ in (jax.jit, jnova.compile):
        compiled = compile_(train_step, static_argnums=1, static_argnames="mode")
        aot = compiled.lower(params, 2.0, x, mode="sin").compile()
        message = str(_raised(lambda: aot(params, _normal(3, 4))))
        assert "'x'" in message and "args[" not in message, (compile_, message)
        overflow = _raised(lambda: compiled(params, 2.0, 2**40))
        assert type(overflow) is OverflowError and " x" in str(overflow) and "args[" not in str(overflow)


# --------------------------------------------------------------------------- warnings at the user's line
no_rule_p = jex_core.Primitive("jnova_test_contract_no_rule")
no_rule_p.def_impl(lambda x: jnp.abs(x))
no_rule_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(no_rule_p, mlir.lower_fun(lambda x: jnp.abs(x), multiple_results=False))


def step_with_a_fallback(x):
    h = jnp.tanh(x) * 2.0
    return no_rule_p.bind(h) + 1.0  # the line the warning names


def test_fallback_warning_is_attributed_to_the_users_line():
    x = _normal(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jnova.compile(step_with_a_fallback)(x)
    assert_trees_close(got, jax.jit(step_with_a_fallback)(x))
    fallback = [c for c in caught if "jnova_test_contract_no_rule" in str(c.message)]
    assert len(fallback) == 1
    assert fallback[0].filename == __file__, fallback[0].filename
    assert fallback[0].lineno == step_with_a_fallback.__code__.co_firstlineno + 2


def test_public_exceptions_are_exported():
    for name in ("CompileError", "DeletedArgumentError", "UnsupportedPrimitiveError", "VerifyError"):
        assert issubclass(getattr(jnova, name), Exception) and name in jnova.__all__


# --------------------------------------------------------------------------- what a signature is
def test_weak_and_strong_values_of_one_leaf_alternate_like_jit():
    """A Python float (weakly typed) and an f32 scalar (strong) have one shape and dtype but promote
    differently against bf16: jax.jit traces each on its own. jnova's last-signature dispatch (jax's
    compiled object, which takes either) must not run one for the other, at the top level or nested."""
    def step(scale, y, hyper):
        return scale * y, hyper["lr"] * y

    y = jnp.arange(4, dtype=jnp.bfloat16) + 1
    compiled, jitted = jnova.compile(step), jax.jit(step)
    calls = [(jnp.float32(1.5), {"lr": jnp.float32(0.5)}), (1.5, {"lr": jnp.float32(0.5)}),
             (1.5, {"lr": 0.5}), (jnp.float32(1.5), {"lr": 0.5}), (jnp.float32(1.5), {"lr": jnp.float32(0.5)})]
    for scale, hyper in calls:
        got, want = compiled(scale, y, hyper), jitted(scale, y, hyper)
        assert [g.dtype for g in got] == [w.dtype for w in want], (scale, hyper)
        assert_trees_close(got, want)
    assert compiled.compile_count == 4


def test_the_jax_configuration_tracing_reads_is_part_of_the_key_like_jit():
    """jax.jit's cache key holds the configuration tracing reads: a step compiled outside a context
    is not reused inside it (the PRNG's partitioning changes the random bits, rank promotion "raise"
    raises)."""
    def sample(key):
        return jax.random.uniform(key, (8,))

    key = jax.random.key(fresh_seed())
    compiled = jnova.compile(sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the PRNG's primitives run as XLA ops, with a warning
        for partitionable in (True, False, True):
            with jax.threefry_partitionable(partitionable):
                assert_trees_close(compiled(key), jax.jit(sample)(key))
    assert compiled.compile_count == 2

    def add(a, b):
        return a + b

    compiled = jnova.compile(add)
    compiled(jnp.ones(3), jnp.ones((2, 1)))
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion|broadcast"):
            jax.jit(add)(jnp.ones(3), jnp.ones((2, 1)))
        with pytest.raises(ValueError, match="rank_promotion|broadcast"):
            compiled(jnp.ones(3), jnp.ones((2, 1)))


def test_debug_nans_raises_floating_point_error_at_the_operation_like_jit():
    """Under jax.debug_nans, a NaN in a compiled step's output makes jax.jit run the function uncompiled
    and raise FloatingPointError where it appears; jnova raises the same error (not jax's private one)."""
    def f(a):
        return jnp.sum(jnp.log(a - 2.0)) + jnp.tanh(a)

    a = jnp.ones(3)
    with jax.debug_nans(True):
        want = _raised(lambda: jax.jit(f)(a))
        got = _raised(lambda: jnova.compile(f)(a))
    assert type(want) is type(got) is FloatingPointError
    assert "log" in str(want) and "log" in str(got)
    assert not jnp.isnan(jnova.compile(f)(a + 2.5)).any()  # and without the context, it just computes


def test_a_step_first_compiled_inside_jit_or_scan_raises_its_training_ops_there():
    """A jnova step whose first call is inside jax.jit or lax.scan compiles there: its raising passes
    compute their probes with JAX ops on NumPy values, which the outer trace staged (a
    TracerArrayConversionError); they run eagerly now, and the results are jax.jit's."""
    import optax

    w, x = _normal(8, 16), _normal(6, 8)
    labels = jnp.arange(6) % 16

    def loss(w, x):
        h = jax.nn.gelu(x @ w)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return optax.softmax_cross_entropy_with_integer_labels(h, labels).mean()

    grad = jax.value_and_grad(loss)
    for kernels in ("auto", "fused"):
        step = jnova.compile(grad, kernels=kernels)
        assert_trees_close(jax.jit(lambda w, x: step(w, x))(w, x), jax.jit(grad)(w, x))
        step = jnova.compile(grad, kernels=kernels)
        scanned = jax.lax.scan(lambda w, _: (w - 0.1 * step(w, x)[1], None), w, length=2)[0]
        assert_trees_close(scanned, jax.lax.scan(lambda w, _: (w - 0.1 * grad(w, x)[1], None), w, length=2)[0])
