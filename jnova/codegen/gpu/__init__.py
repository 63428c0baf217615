"""The GPU backend: fused kernels as `gpu.module`s, lowered to PTX.

    Kernel --build_gpu_module--> gpu.module text (contraction.py | elementwise.py | reduction.py | scatter.py)
           --to_ptx-----------> PTX (ptx.py: NVVM lowering, NVPTX backend)
           = GpuLaunch (PTX + grid, block, shared memory, aliases), what `nova_kernel_p`'s CUDA lowering launches

`compile.py` holds that sequence (`launch.py` the GpuLaunch, apart so that running a kernel needs no
builder); `evaluate.py` is the register-level evaluator the elementwise, reduction and scatter builders
share (`remaps.py`: its data-movement ops), `emitter.py` the text emitter (which also runs the linalg
lowering rules' scalar bodies inline).
"""
