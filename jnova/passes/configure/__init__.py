"""The Analytic Configurator: a contraction's schedule derived from its shape and the `Target`
(Nova report, section 4.4), one module per decision.

Every decision is pure and deterministic (no search, no GPU, microseconds) and reads the machine only
through `Target` (including `Target.tensor_maps`: whether the kernel may take TMA descriptors).

- `problem`: what is decided about: `ContractionProblem` and `contraction_problem` (a `nova.matmul` as
  one, or why not);
- `tile_config`: the result, `TileConfig`, which prints as one line that `TileConfig.parse` reads back
  (so a printed config is an override);
- `mma_instruction`: the MMA instruction from the operand dtype and the target's features;
- `tile_shape`: the block tile, from arithmetic intensity and SM fill;
- `warp_grid`: the warps of a block tile;
- `pipeline_depth`: shared-memory stages, block_k and the swizzle;
- `warp_specialized`: whether the TMA-fed ping-pong kernel takes the contraction, and its tile;
- `tile_schedule`: `choose_tiles`, the decisions above composed into one `TileConfig`;
- `contraction_time`: the main-loop time model that the plan-level decisions weigh options with;
- `operand_transposes`: whether TF32 operands are copied K-major by a kernel of their own first;
- `split_k`: whether a contraction is split into partial products over K;
- `reduction_split`: whether a reduction into few rows is split into partial reductions;
- `attention_tiles`: the fused attention kernels' tiles, from their key loop's shared-memory footprint;
- `cross_entropy_rows`: the cross-entropy row kernels' team, vector and unroll, from the bytes per row,
  the SMs' occupancy and the DRAM latency to cover.
"""
