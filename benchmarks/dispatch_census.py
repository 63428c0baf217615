"""Where a GPT-2 step's host dispatch goes: jnova against jax.jit, in one process.

    JAX_PLATFORMS=cuda python benchmarks/dispatch_census.py [--batch 1 --seq 64 --rounds 100]

For each side, from XLA's optimized HLO: the entry computation's instructions by opcode (each a thunk;
XLA 0.11 forms its command buffers from the thunks, after the HLO, so they do not show here). Then
host dispatch (as benchmarks/dispatch.py measures it) of jnova's step called as users call it, of the
compiled step that call tries first ("jnova-compiled"), and of the flat jitted function underneath
("jnova-jit-only"), beside XLA's.
Prints one JSON object; appends it to $OUT/dispatch_census.jsonl when OUT is set.
"""
from __future__ import annotations

import collections
import re
import statistics

import jax

from dispatch import dispatch_seconds
from gpt2_step import compile_step, emit, parser, setup

INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(")  # the type may be a tuple


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instructions' opcodes."""
    out, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{$", line)  # unindented: a computation
        if header:
            current = out.setdefault(header.group(1), [])
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            current.append(m.group(1))
    return out


def census(hlo: str) -> dict:
    comps = computations(hlo)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
    thunks = collections.Counter(op for op in comps[entry] if op not in ("parameter", "get-tuple-element", "tuple",
                                                                         "bitcast", "constant"))
    return {"entry_thunks": sum(thunks.values()), "entry_ops": dict(thunks.most_common(12))}


def main():
    p = parser(steps=0, impl=False)
    p.set_defaults(batch=1, seq=64)
    p.add_argument("--rounds", type=int, default=100)
    args = p.parse_args()
    config, step, batch = setup(args.batch, args.seq, args.layers)
    compiled, _ = compile_step("jnova", args.dtype, step, batch)
    executable = compiled.lower(*batch).executable
    flat = jax.tree_util.tree_leaves((batch, {}))
    inner = executable.run
    xla_run, _ = compile_step("xla", args.dtype, step, batch)
    sides = {"jnova": (compiled, batch), "jnova-jit-only": (inner, flat), "xla": (xla_run, batch)}
    for run, a in sides.values():
        for _ in range(3):
            jax.block_until_ready(run(*a))
    sides["jnova-compiled"] = (compiled._last, batch)  # jax's compiled step jnova's call tries first
    times = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (list(sides) if r % 2 else list(sides)[::-1]):
            run, a = sides[side]
            times[side].append(dispatch_seconds(run, a))
    record = {"bench": "dispatch_census", "case": f"B{args.batch}xT{args.seq}xL{args.layers}", "dtype": args.dtype,
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "dispatch_ms": {s: round(statistics.median(t) * 1e3, 3) for s, t in times.items()},
              "jnova": census(compiled._last.as_text()),  # the executable jnova's call runs
              "xla": census(xla_run.as_text())}
    print(record)
    emit("dispatch_census.jsonl", [record])


if __name__ == "__main__":
    main()
