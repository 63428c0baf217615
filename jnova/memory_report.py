"""The memory report of a compiled step: its peak, and the buffers live at the peak (`Lowered.memory()`).

Everything in it is what XLA planned for the step around jnova's kernels: the peak and the buffers at
it come from XLA's live ranges of the compiled module (runtime/xla_buffers.py), the totals from its
memory analysis. Each buffer is mapped back to jnova through the op_name XLA keeps on every
instruction: jnova's executor binds each kernel under a name scope of the kernel's name, so a custom
call's op_name reads ".../kernel_12/nova_kernel" (or ".../kernel_12/pure_callback" on the CPU), and
the plan says which value each of the kernel's outputs is and which nova op computed it.

A buffer's kind:
- "parameter", "optimizer state", "input": an argument of the step (XLA names it by its pytree path:
  a path through an attribute, such as optax's `.mu`, is optimizer state; other floating-point
  arguments are parameters; the rest inputs);
- "output": a value the step returns (not held in a donated argument's buffer);
- "residual": computed before the peak and read after it: held across the peak for a later reader
  (in a training step, what the forward pass saves for the backward);
- "temporary": computed at the peak, or read for the last time there.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from jnova.runtime.xla_buffers import Instruction, LiveRanges, element_shape, parse_entry, parse_live_ranges

_KERNEL = re.compile(r"(?:^|/)((?:kernel|view)_\d+(?:_batch\d+)?)(?:/|$)")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8}
_DTYPE = {"pred": "bool", "s8": "int8", "u8": "uint8", "s16": "int16", "u16": "uint16", "f16": "float16",
          "bf16": "bfloat16", "s32": "int32", "u32": "uint32", "f32": "float32", "s64": "int64", "u64": "uint64",
          "f64": "float64"}
_SOURCE_FOLDERS = re.compile(r"(?<=at )\S*/")  # "nova.add at /a/b/model.py:12" -> "nova.add at model.py:12"
_PASS_THROUGH = ("bitcast", "copy", "get-tuple-element", "tuple", "copy-start", "copy-done")


@dataclass
class Buffer:
    """One buffer live at the peak."""

    bytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str            # parameter, optimizer state, input, output, residual, temporary
    value: str           # the argument's path, or "kernel_12 result 0", or XLA's instruction
    made_by: str         # the kernel and nova op (or the XLA op) that wrote it; "" for an argument
    last_read_by: str    # the kernel (or XLA op) that reads it last; "end of step" if live to the end
    xla_buffer: str      # XLA's name for it: "instruction{shape index}"
    live: tuple[int, int]  # its live range over XLA's instruction sequence


@dataclass
class MemoryReport:
    peak_bytes: int                   # XLA's peak of the step: the bytes live at its peak instruction
    allocated_bytes: int              # what XLA allocates for a call: arguments + temporaries + outputs - aliased
    peak_at: str                      # the instruction at the peak, and the kernel it runs
    instructions: int                 # XLA's instruction sequence length
    analysis: dict                    # compiled.memory_analysis(): argument, output, alias, temp bytes
    buffers: list[Buffer] = field(default_factory=list)  # live at the peak, largest first

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.buffers:
            out[b.kind] = out.get(b.kind, 0) + b.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "by_kind": self.by_kind()}, indent=1)

    def __str__(self) -> str:
        a = self.analysis
        lines = [f"peak {_mb(self.peak_bytes)} at instruction {self.peak_at} (of {self.instructions}); "
                 f"XLA allocates {_mb(self.allocated_bytes)} for a call",
                 "XLA memory analysis: " + ", ".join(f"{k} {_mb(v)}" for k, v in a.items()),
                 "live at the peak: " + ", ".join(f"{k} {_mb(v)}" for k, v in self.by_kind().items()),
                 f"{'MB':>9}  {'dtype':<9} {'shape':<22} {'kind':<16} {'value':<40} {'made by':<44} last read by"]
        for b in self.buffers:
            lines.append(f"{b.bytes / 1e6:9.3f}  {b.dtype:<9} {str(list(b.shape)):<22} {b.kind:<16} "
                         f"{b.value[:40]:<40} {b.made_by[:44]:<44} {b.last_read_by}")
        return "\n".join(lines) + "\n"


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB"


def memory_report(texts: dict[str, str], analysis, plan: dict) -> MemoryReport:
    """The report from XLA's dump texts ("hlo", "live_range"), its memory analysis and jnova's plan JSON."""
    entry = parse_entry(texts["hlo"])
    live = parse_live_ranges(texts["live_range"])
    if live.peak_position is None:
        raise ValueError("XLA's live ranges name no peak ('Live ranges at N (peak)')")
    outputs = _kernel_outputs(plan)
    returned = set(plan["returns"])
    buffers = [_buffer(name, size, entry, live, outputs, returned) for name, size in live.peak]
    buffers.sort(key=lambda b: -b.bytes)
    at = live.sequence[live.peak_position] if live.peak_position < len(live.sequence) else "end"
    where = _kernel_of(entry, at)
    stats = {k: int(getattr(analysis, f"{k}_size_in_bytes", 0) or 0)
             for k in ("argument", "output", "alias", "temp")} if analysis is not None else {}
    allocated = stats.get("argument", 0) + stats.get("temp", 0) + stats.get("output", 0) - stats.get("alias", 0)
    return MemoryReport(sum(size for _, size in live.peak), allocated, f"{live.peak_position} ({at}{': ' + where if where else ''})",
                        len(live.sequence), stats, buffers)


def _kernel_outputs(plan: dict) -> dict[str, list[tuple[int, str]]]:
    """kernel name -> [(value id, the nova op that made it)] for each of its outputs."""
    out = {}
    for step in plan["steps"]:
        name = step.get("kernel") or step.get("view")
        if name:
            made = step.get("made_by") or [""] * len(step["out"])
            out[name] = list(zip(step["out"], made))
    return out


def _kernel_of(entry: dict[str, Instruction], name: str) -> str:
    """The jnova kernel (or view) an XLA instruction runs, from its op_name; else the op_name's last part."""
    inst = entry.get(name)
    if inst is None:
        return ""
    m = _KERNEL.search(inst.op_name)
    if m:
        return m.group(1)
    return inst.op_name.rsplit("/", 1)[-1] if inst.op_name else f"XLA {inst.opcode}"


def _source(entry: dict[str, Instruction], name: str, index: tuple[int, ...]) -> tuple[Instruction | None, tuple]:
    """The instruction that computes buffer `name{index}`, looking through copies, bitcasts and tuples."""
    inst = entry.get(name)
    while inst is not None and inst.opcode in _PASS_THROUGH and inst.operands:
        if inst.opcode == "get-tuple-element":
            inst, index = entry.get(inst.operands[0]), (inst.tuple_index or 0, *index)
            continue
        if inst.opcode == "tuple":
            if not index:
                break
            inst, index = entry.get(inst.operands[index[0]]), index[1:]
            continue
        inst = entry.get(inst.operands[0])
    return inst, index


def _buffer(name: str, size: int, entry, live: LiveRanges, outputs, returned) -> Buffer:
    rng = live.ranges.get(name)
    inst_name = rng.instruction if rng else name.split("{")[0]
    index = rng.index if rng else ()
    inst = entry.get(inst_name)
    shape = element_shape(inst.shape, index) if inst else None
    dtype, dims = shape if shape else ("?", ())
    start, end = (rng.start, rng.end) if rng else (0, 0)
    last = "end of step" if end >= len(live.sequence) else _last_reader(entry, live, end)
    if inst is not None and inst.parameter is not None:
        path = inst.op_name or f"argument {inst.parameter}"
        return Buffer(size, _DTYPE.get(dtype, dtype), dims, _argument_kind(path, dtype), path, "", last, name,
                      (start, end))
    source, src_index = _source(entry, inst_name, index)
    kernel = _kernel_of(entry, source.name) if source is not None else ""
    value, made_by, value_id = inst_name, kernel, None
    if kernel in outputs:
        results = outputs[kernel]
        j = src_index[0] if src_index else 0
        if j < len(results):
            value_id, op = results[j]
            value = f"{kernel} result {j}"
            made_by = f"{kernel}: {_SOURCE_FOLDERS.sub('', op)}" if op else kernel
    if inst is not None and inst.opcode == "copy" and source is not None:
        made_by = f"XLA copy of {made_by or source.name}"
    peak = live.peak_position
    if value_id is not None and value_id in returned and end >= len(live.sequence):
        kind = "output"
    elif end >= len(live.sequence) and kernel == "":
        kind = "output"
    elif start < peak < end:
        kind = "residual"
    else:
        kind = "temporary"
    return Buffer(size, _DTYPE.get(dtype, dtype), dims, kind, value, made_by, last, name, (start, end))


def _last_reader(entry, live: LiveRanges, end: int) -> str:
    at = live.sequence[end] if end < len(live.sequence) else ""
    kernel = _kernel_of(entry, at)
    return f"{kernel} ({at})" if kernel and kernel != at else at


def _argument_kind(path: str, dtype: str) -> str:
    if re.search(r"\.[A-Za-z_]\w*", path):  # an attribute on the way: a NamedTuple's field (optax states)
        return "optimizer state"
    return "parameter" if dtype.startswith(("f", "bf")) else "input"
