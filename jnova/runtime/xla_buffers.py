"""XLA's buffer plan of a compiled module, read from its dump (`jax_internals.compile_with_buffer_dump`).

Two texts XLA writes for every module it compiles:
- the scheduled HLO (`*_after_optimizations.txt`): each instruction's name, shape, opcode, operands
  and `metadata={op_name="..."}` (the JAX name stack of the op it came from);
- the live ranges (`*_after_optimizations-live-range.txt`, XLA's `HloLiveRange::ToString`): the
  instruction sequence, every buffer's live range over it as `name{shape index}:start-end`, and the
  buffers live at the peak (`Live ranges at N (peak):`, one `name{index}: S bytes` line each).

A buffer is named by the instruction that defines it and the index into its (tuple) shape; buffers
XLA made one (an in-place output and its operand, a donated argument and its result) are one buffer,
named once. Buffers are defined in the entry computation and in computations it calls (a GPU
command buffer); what XLA runs inside a fusion lives in registers or in the fusion's output.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PARAMETER = re.compile(r"^parameter\((\d+)\)")
_BUFFER = re.compile(r"^\s+(\S+?)(\{[0-9,]*\}):\s*(\d+)-(\d+)\s*$")
_PEAK_HEADER = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_PEAK_BUFFER = re.compile(r"^\s+(\S+?)(\{[0-9,]*\}): (\d+) bytes")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


@dataclass
class Instruction:
    name: str
    shape: str          # as printed: "f32[2,3]{1,0}" or a tuple "(f32[2], s32[])"
    opcode: str
    operands: list[str]
    op_name: str        # metadata op_name ("" when XLA made the instruction without one)
    parameter: int | None = None  # the entry parameter number, for `parameter(k)`
    tuple_index: int | None = None  # a get-tuple-element's index


@dataclass
class BufferRange:
    name: str           # "instruction{index}"
    instruction: str
    index: tuple[int, ...]
    start: int
    end: int


@dataclass
class LiveRanges:
    sequence: list[str]                    # instruction names in XLA's schedule
    ranges: dict[str, BufferRange]         # "instruction{index}" -> range
    peak_position: int | None
    peak: list[tuple[str, int]] = field(default_factory=list)  # ("instruction{index}", bytes) live at the peak


def parse_entry(hlo_text: str) -> dict[str, Instruction]:
    """Every computation's instructions by name (XLA's names are unique in a module): the entry
    computation's, and those of computations it calls, where a buffer may be defined too (a GPU
    command buffer's `call` holds the kernels it launches). Only the entry's parameters are the step's
    arguments."""
    lines = hlo_text.splitlines()
    if not any(l.startswith("ENTRY ") for l in lines):
        raise ValueError("no ENTRY computation in XLA's HLO text")
    out, in_entry = {}, False
    for line in lines:
        if line.startswith(("ENTRY ", "%")) and line.rstrip().endswith("{"):
            in_entry = line.startswith("ENTRY ")
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        operands = re.findall(r"%([^\s,()]+)", rest.split("), ", 1)[0] if "), " in rest else rest.rstrip(")"))
        op_name = _OP_NAME.search(line)
        param = _PARAMETER.match(f"{opcode}({rest}") if in_entry else None
        gte = re.search(r"\bindex=(\d+)", rest) if opcode == "get-tuple-element" else None
        out[name] = Instruction(name, shape, opcode, operands, op_name.group(1).replace("\\'", "'") if op_name else "",
                                int(param.group(1)) if param else None, int(gte.group(1)) if gte else None)
    return out


def parse_live_ranges(text: str) -> LiveRanges:
    sequence, ranges, peak, position = [], {}, [], None
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "InstructionSequence:":
            section = "sequence"
            continue
        if stripped == "BufferLiveRange:":
            section = "ranges"
            continue
        m = _PEAK_HEADER.match(line)
        if m:
            section, position = "peak", int(m.group(1))
            continue
        if section == "sequence":
            m = re.match(r"^\s+(\d+):(\S+)\s*$", line)
            if m:
                sequence.append(m.group(2))
                continue
            section = None
        if section == "ranges":
            m = _BUFFER.match(line)
            if m:
                name, index, start, end = m.groups()
                ranges[name + index] = BufferRange(name + index, name, _index(index), int(start), int(end))
                continue
            section = None
        if section == "peak":
            m = _PEAK_BUFFER.match(line)
            if m:
                peak.append((m.group(1) + m.group(2), int(m.group(3))))
                continue
            section = None
    return LiveRanges(sequence, ranges, position, peak)


def _index(text: str) -> tuple[int, ...]:
    inner = text.strip("{}")
    return tuple(int(p) for p in inner.split(",")) if inner else ()


def element_shape(shape: str, index: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
    """(XLA dtype, dims) of the array at `index` of a printed shape; None for a tuple or a token."""
    if index:
        inner = shape.strip()
        if not inner.startswith("("):
            return None
        parts = _split_tuple(inner[1:-1])
        if index[0] >= len(parts):
            return None
        return element_shape(parts[index[0]], index[1:])
    m = _ARRAY.match(shape.strip())
    if not m or shape.strip().startswith("("):
        return None
    dtype, dims = m.groups()
    return dtype, tuple(int(d) for d in dims.split(",")) if dims else ()


def _split_tuple(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts
