"""A function's fusion groups, and its run with one kernel per group on the CPU."""
from jnova.passes.fuse import fuse
from helpers.nova_funcs import nova_func


def fusion_of(fn, *args):
    func = nova_func(fn, *args)
    return func, fuse(func)


def grouped_run(fn, *args):
    """Run `fn` through the CPU backend with one kernel per fusion group (the GPU plan)."""
    import jnova

    step = jnova.compile(fn, backend="cpu", kernels="fused")
    return step(*args), step.stats()[0]["kernels"]
