"""Programs found by differential runs that are kept as they were found (the minimized ones live in
tests/test_regressions.py). Each is difftest program text (`Program.parse`) and the data seed it failed with."""

# H200 run of 2026-11-30, shard 36: jnova's GPU step gave a wrong forward output and loss (gradient right).
CUMMAX_BF16_SEED = 939
CUMMAX_BF16 = """
# difftest program: longest_sum=4 has_bf16=True has_contraction=False
def loss(params, data):
    p0 = params['p0']  # bfloat16[3, 7]
    p1 = params['p1']  # bfloat16[]
    s_v3 = data['s_v3']  # float32[1, 4]
    v0 = lax.cummax(p0, axis=1)  # bfloat16[3, 7]
    v1 = v0[0:1]  # bfloat16[1, 7]
    v2 = lax.cummax(v1, axis=1)  # bfloat16[1, 7]
    v3 = jnp.split(v2, [3], axis=1)[1]  # bfloat16[1, 4]
    outs = [v3]
"""
