"""Read the TPU compiler's final VLIW schedule of one kernel.

libtpu writes, per HLO op, ``*-packed-bundles-post-ra.txt``: one bundle per
line, one bundle per core cycle, empty bundles kept (TPU cores are statically
scheduled, so a bundle count *is* a cycle count). This module parses that text
into what the estimator needs: the grid loop, the predicated regions inside it
(``pl.when`` bodies and the pipeline's own guards), where the MXU work sits,
and the DMAs. Pure text processing: no jax, so the tests run on stored dumps.

Facts the parser relies on (libtpu 0.0.52):
- a bundle line starts with its index (``0`` then ``0x1``, ``0x2`` ...), an
  optional marker (``LB:`` loop body, ``PF:`` predicated fallthrough, ...),
  and ``{ op ;; op ... }``; long DMA comments continue on the next lines;
- ``sbr.rel (pred) target bundleno = T`` is a relative branch with 4 delay
  slots: the bundles ``[branch + 5, T)`` are skipped when it is taken (forward
  branch), and a backward branch to ``T`` closes a loop of ``branch + 5 - T``
  bundles;
- ``dma.done.wait ..., <granules>``, ``dma.hbm_to_vmem`` / ``dma.vmem_to_hbm``
  with ``size_in_granules=``: one granule is 32 bytes.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np

BRANCH_DELAY_SLOTS = 4
GRANULE_BYTES = 32

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:([A-Z]{2}))?:\s*>*\s*\{")
_BRANCH = re.compile(r"sbr\.rel\s*(\([^)]*\))?\s*target bundleno = (\d+)")
_MXU_OP = re.compile(r"= vmat(?:mul|push)[\w.]*")
_DMA_ISSUE = re.compile(r"dma\.(hbm_to_vmem|vmem_to_hbm)\b.*?size_in_granules=\*/(\d+)")
_OPERAND = re.compile(r"inlined_call_operand\.(<no memory space>|\w+) \[shape: (.+?), index: (\d+), kind: (\w+)")


@dataclasses.dataclass(frozen=True)
class Region:
    """Bundles ``[start, end)`` that a forward branch at ``branch`` skips when taken."""

    branch: int
    start: int
    end: int
    predicate: str
    mxu_ops: int

    @property
    def cycles(self) -> int:
        return self.end - self.start

    def contains(self, other: "Region") -> bool:
        return self.start <= other.start and other.end <= self.end and self != other


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop closed by a backward branch: bundles ``[start, end)``, ``end = branch + 5``."""

    start: int
    end: int

    @property
    def cycles(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Dma:
    bundle: int
    direction: str  # "hbm_to_vmem" or "vmem_to_hbm"
    bytes: int


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand of the kernel as the compiler placed it: ``memory`` is
    ``hbm`` (blocks are DMA'd per grid step) or ``vmem`` (XLA put the whole
    array in VMEM before the kernel), ``smem`` / ``<no memory space>`` for
    scalars."""

    index: int
    kind: str  # input / output
    memory: str
    shape: str


@dataclasses.dataclass(frozen=True)
class Schedule:
    bundles: tuple[str, ...]
    loops: tuple[Loop, ...]
    regions: tuple[Region, ...]
    dmas: tuple[Dma, ...]
    operands: tuple[Operand, ...]

    @property
    def total_cycles(self) -> int:
        return len(self.bundles)

    def grid_loop(self) -> Loop:
        """The outermost loop: Pallas flattens the grid into one pipelined loop."""
        if not self.loops:
            raise ValueError("schedule has no loop: a kernel with a grid of one step, or not a Pallas kernel")
        return max(self.loops, key=lambda lp: lp.cycles)

    def inner_loops(self) -> tuple[Loop, ...]:
        outer = self.grid_loop()
        return tuple(lp for lp in self.loops if lp != outer and outer.start <= lp.start and lp.end <= outer.end)

    def regions_in(self, loop: Loop) -> tuple[Region, ...]:
        return tuple(r for r in self.regions if loop.start <= r.start and r.end <= loop.end)

    def innermost_mxu_regions(self, loop: Loop) -> tuple[Region, ...]:
        """Predicated regions with MXU work and no MXU region nested in them,
        in bundle order: the ``pl.when`` bodies that hold the matmuls."""
        mxu = [r for r in self.regions_in(loop) if r.mxu_ops]
        return tuple(r for r in mxu if not any(r.contains(o) for o in mxu))

    def mxu_ops_in(self, start: int, end: int) -> int:
        return sum(len(_MXU_OP.findall(b)) for b in self.bundles[start:end])


def parse(text: str) -> Schedule:
    bundles: list[str] = []
    for line in text.splitlines():
        m = _BUNDLE.match(line)
        if m:
            index = int(m.group(1), 0)
            if index != len(bundles):
                raise ValueError(f"bundle {index} follows bundle {len(bundles) - 1}: not a packed-bundles dump")
            bundles.append(line)
        elif bundles:
            bundles[-1] += "\n" + line  # a DMA comment continues
    if not bundles:
        raise ValueError("no bundles found: expected a *-packed-bundles-post-ra.txt dump")
    mxu_prefix = [0]
    for b in bundles:
        mxu_prefix.append(mxu_prefix[-1] + len(_MXU_OP.findall(b)))
    loops, regions, dmas, operands = [], [], [], []
    for i, b in enumerate(bundles):
        for pred, target in _BRANCH.findall(b):
            target = int(target)
            after = i + BRANCH_DELAY_SLOTS + 1
            if target <= i:
                loops.append(Loop(target, after))
            elif target > after:
                regions.append(Region(i, after, target, pred.strip("()"), mxu_prefix[target] - mxu_prefix[after]))
        for direction, granules in _DMA_ISSUE.findall(b):
            dmas.append(Dma(i, direction, int(granules) * GRANULE_BYTES))
    for memory, shape, index, kind in _OPERAND.findall(bundles[0]):
        operands.append(Operand(int(index), kind, memory, shape))
    return Schedule(tuple(bundles), tuple(loops), tuple(regions), tuple(dmas), tuple(operands))


def read(path: str | pathlib.Path) -> Schedule:
    return parse(pathlib.Path(path).read_text())


# "<id>-<hlo op>-<pass>-packed-bundles-post-ra.txt"; TLP and <late-...> are
# the program's top level, not ops.
DUMP_NAME = re.compile(r"^\d+-(.+)-\d+-packed-bundles-post-ra\.txt$")


def _dumps_by_op(dump_dir) -> dict[str, pathlib.Path]:
    out = {}
    for p in pathlib.Path(dump_dir).iterdir():
        m = DUMP_NAME.match(p.name)
        if m and m.group(1) != "TLP" and not m.group(1).startswith("<"):
            out[m.group(1)] = p
    return out


def _op_base(op: str) -> tuple[str, int]:
    """XLA names the calls of one kernel ``name``, ``name.1``, ..."""
    m = re.fullmatch(r"(.+?)(?:\.(\d+))?", op)
    return m.group(1), int(m.group(2) or 0)


def kernel_dumps(dump_dir: str | pathlib.Path, kernel_name: str) -> list[pathlib.Path]:
    """The bundle files of every call of the Pallas kernel ``kernel_name``,
    in the order XLA numbered them, which is program order."""
    found = sorted((_op_base(op)[1], p) for op, p in _dumps_by_op(dump_dir).items()
                   if _op_base(op)[0] == kernel_name)
    if not found:
        raise FileNotFoundError(f"no bundle dump of kernel {kernel_name!r} in {dump_dir}")
    return [p for _, p in found]


# An array of a shape string, with its layout where printed (``S(1)``: VMEM).
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\](\{[^}]*\})?")


def array_bytes(shape: str) -> int:
    """Bytes of the arrays an operand shape names (``bf16[8,128]``, or a tuple)."""
    total = 0
    for dtype, dims, _ in _ARRAY.findall(shape):
        itemsize = 1 if dtype == "pred" else max(int(re.sub(r"\D", "", dtype.split("e")[0])) // 8, 1)
        total += itemsize * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


# The optimized HLO module of the compile, written next to its bundle dumps
# (tpu_estimator.compile_with_dump): libtpu dumps one bundle file per distinct
# program, so of several identical fusions (a combine's per-pick gathers) only
# one has a file; the module names them all.
HLO_MODULE = "hlo_module.txt"


def _balanced(text: str, start: int) -> int:
    """Index past the parenthesis closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in {text!r}")


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    name: str
    shape: str  # with layouts (``S(1)``: placed in VMEM)
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def entry_instructions(module: str) -> dict[str, HloInstruction]:
    """The ENTRY computation's instructions of an HLO module's text."""
    entry = module[module.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    out = {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if not m:
            continue
        rest = line[m.end():]
        shape_end = _balanced(rest, 0) if rest.startswith("(") else rest.index(" ")
        shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
        opcode = rest[:rest.index("(")]
        args_end = _balanced(rest, len(opcode))
        operands = tuple(re.findall(r"%([\w.\-]+)", rest[len(opcode):args_end]))
        out[m.group(1)] = HloInstruction(m.group(1), shape, opcode, operands, rest[args_end:])
    return out


def _arrays(shape: str):
    """(dtype, dims, in HBM) of each array a shape names."""
    return [(dtype, dims, "S(" not in (layout or "")) for dtype, dims, layout in _ARRAY.findall(shape)]


def _signature(ins: HloInstruction, instructions) -> tuple:
    """What makes two fusions the same program: opcode, fusion kind, and the
    dtypes and dims (not the memory spaces) of their result and operands."""
    def arrays(shape):
        return tuple((dtype, dims) for dtype, dims, _ in _arrays(shape))

    kind = re.search(r"kind=(\w+)", ins.attributes)
    return (ins.opcode, kind and kind.group(1), arrays(ins.shape),
            tuple(arrays(instructions[o].shape) if o in instructions else o for o in ins.operands))


def hbm_bytes(op: str, operands) -> int:
    """Bytes an XLA op moves through HBM: its operands ``(kind, in HBM,
    bytes)`` placed there, read or written. A gather fusion reads only the
    rows it gathers, at most as many elements of a source as it writes: each
    HBM input is charged at most the op's output bytes (a combine of ``top_k``
    per-pick gathers from one ``[rows, H]`` array reads ``rows / top_k`` of
    its rows each, not all of them)."""
    written = sum(b for kind, _, b in operands if kind == "output")
    gather = op.startswith("gather_fusion")
    return sum(min(b, written) if gather and kind == "input" else b for kind, hbm, b in operands if hbm)


def _hlo_operands(ins: HloInstruction, instructions) -> list[tuple[str, bool, int]]:
    def entries(shape, kind):
        return [(kind, hbm, array_bytes(f"{dtype}[{dims}]")) for dtype, dims, hbm in _arrays(shape)]

    out = entries(ins.shape, "output")
    for o in ins.operands:
        if o in instructions:
            out += entries(instructions[o].shape, "input")
    return out


def other_ops(dump_dir: str | pathlib.Path, kernel_names: set[str]) -> dict[str, tuple[int, int]]:
    """Every other HLO op of the program: (static cycles, ``hbm_bytes``). A
    fusion without a bundle file of its own (libtpu dumped its identical
    twin) takes its twin's cycles and its own operands' bytes."""
    out = {}
    for op, p in _dumps_by_op(dump_dir).items():
        if _op_base(op)[0] in kernel_names:
            continue
        s = parse(p.read_text())
        out[op] = (s.total_cycles, hbm_bytes(op, [(o.kind, o.memory == "hbm", array_bytes(o.shape))
                                                  for o in s.operands]))
    module = pathlib.Path(dump_dir) / HLO_MODULE
    return with_twins(out, entry_instructions(module.read_text())) if module.exists() else out


def with_twins(ops: dict[str, tuple[int, int]], instructions: dict[str, HloInstruction]) -> dict:
    """``ops`` plus every fusion of the module without a bundle file whose
    identical twin has one: the twin's cycles, the fusion's own HBM bytes."""
    out = dict(ops)
    dumped = {_signature(instructions[op], instructions): op for op in ops if op in instructions}
    for name, ins in instructions.items():
        if ins.opcode != "fusion" or name in out:
            continue
        twin = dumped.get(_signature(ins, instructions))
        if twin is not None:
            out[name] = (ops[twin][0], hbm_bytes(name, _hlo_operands(ins, instructions)))
    return out
