"""The GPU backend: fused kernels as `gpu.module`s, lowered to PTX.

    Kernel --build_gpu_module--> gpu.module text (elementwise.py | reduction.py)
           --to_ptx-----------> PTX (ptx.py: NVVM lowering, NVPTX backend)
           = GpuLaunch (PTX + grid, block, shared memory), what `nova_kernel_p`'s CUDA lowering launches

`compile.py` holds that sequence; `evaluate.py` is the register-level evaluator both kernel builders
share, `emitter.py` the text emitter (which also runs the linalg lowering rules' scalar bodies inline).
"""
