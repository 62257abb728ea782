"""Which path each kernel takes on this machine: `report()`, read from the C++ dispatch (dispatch.h) that the
kernels themselves consult, never re-derived here, so it says what runs. A B=1 decode on AMD runs AVX2's 1-row
tiles though `available()` says "avx512"; the report shows that row by row."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2_jax.kernels import ffi

ROWS = (1, 8, 512)  # a decode step at B=1, a decode step at B=8, a prefill
WIDTH = 768  # the reduction length asked about (gpt2-small's width: int8's AMX and VNNI paths depend on it)
OPS = ("rowdot", "int8", "w8a8", "packed", "chain", "softmax", "argmax", "cumsum")


@dataclass(frozen=True)
class Report:
    """paths[op][i]: the path `op` takes at rows[i] rows ("xla" where the kernels do not run)."""

    rows: tuple[int, ...]
    width: int
    paths: dict[str, tuple[str, ...]]
    features: dict[str, object]  # what dispatch.h read: f32, int8, vbmi, amd, one_row_avx2, forced
    why_not: str | None  # why the kernels do not run here, or None

    def __str__(self) -> str:
        if self.why_not is not None:
            return f"kernels: off ({self.why_not}); every op runs on XLA"
        f = self.features
        head = (
            f"kernels: float32 {f['f32']}, int8 {f['int8']}, vbmi {'yes' if f['vbmi'] else 'no'}, "
            f"{'AMD' if f['amd'] else 'not AMD'}" + (f", forced {f['forced']}" if f["forced"] else "")
        )
        cols = [f"{r} row{'s' if r > 1 else ''}" for r in self.rows]
        table = [("op", *cols)] + [(op, *self.paths[op]) for op in OPS]
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
        return "\n".join([head + f" (paths at K = {self.width}):"] + ["  " + line for line in lines])


def report(rows: tuple[int, ...] = ROWS, width: int = WIDTH) -> Report:
    """Every op's path at each row count in `rows` (K = `width`), as the kernels pick it on this CPU."""
    lib = ffi.dispatch_module()
    if lib is None:
        return Report(tuple(rows), width, {op: ("xla",) * len(rows) for op in OPS}, {}, ffi.why_unavailable())
    by_rows = [lib.paths(int(r), int(width)) for r in rows]
    return Report(tuple(rows), width, {op: tuple(p[op] for p in by_rows) for op in OPS}, lib.features(), None)
