"""Sweep grids: one axis spec (`8,16,32`, `8-48+8`, `0.05-0.2+0.05`, mixes) -> its values.

Owns: the grid syntax and its errors, and `parse_batch_sizes` (bench's and sweep's `--batch-size` list). Must not: know about cells, models or measuring (measure/sweep.py).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from dgcli.errors import UserError

_GRID_SYNTAX = "comma list and/or inclusive ranges a-b+step, e.g. 8,16,32 or 8-48+8 or 0.05-0.2+0.05 or 4,8-16+4"
_NUM = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"
_RANGE_RE = re.compile(rf"^{_NUM}-{_NUM}\+{_NUM}$")
_MAX_GRID = 10_000  # a typo like 0-1e9+1 should be an error, not a sweep that never ends


def parse_grid_values(spec: str, kind: type) -> list:
    """Parse a sweep axis: `8,16,32`, `8-48+8` (inclusive), `0.05-0.2+0.05`, or mixes (`4,8-16+4`).

    `kind` is int or float. Ranges are computed in decimal arithmetic so
    0.05-0.2+0.05 gives exactly [0.05, 0.1, 0.15, 0.2] with no float drift and the end included when
    the steps land on it. Duplicates are dropped, first occurrence kept. A bad spec is a `UserError`
    quoting it and showing the syntax.
    """
    def bad(why: str) -> UserError:
        return UserError(f"bad grid {spec!r}: {why}; use a {_GRID_SYNTAX}")

    if kind not in (int, float):
        raise TypeError(f"parse_grid_values: kind must be int or float, not {kind!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise bad("empty")
    out: list = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            raise bad("empty item between commas")
        m = _RANGE_RE.match(item)
        if m:
            a, b, step = (Decimal(g) for g in m.groups())
            if step <= 0:
                raise bad(f"step of {item!r} must be > 0")
            if b < a:
                raise bad(f"range {item!r} runs backwards (write the smaller number first)")
            count = int((b - a) / step) + 1
            if len(out) + count > _MAX_GRID:
                raise bad(f"range {item!r} has {count} values (limit {_MAX_GRID})")
            nums = [a + i * step for i in range(count)]
        else:
            try:
                nums = [Decimal(item)]
            except InvalidOperation:
                raise bad(f"{item!r} is neither a number nor a range") from None
            if not nums[0].is_finite():
                raise bad(f"{item!r} is not a finite number")
        for n in nums:
            if kind is int:
                if n != n.to_integral_value():
                    raise bad(f"{item!r} gives {n}, but this setting takes whole numbers")
                out.append(int(n))
            else:
                out.append(float(n))
    return list(dict.fromkeys(out))


def parse_batch_sizes(spec: str) -> list[int]:
    """`--batch-size 1,2,4,8` (bench and sweep; grid syntax, so 1-8+1 works too) -> whole numbers >= 1, in
    the order given, duplicates dropped. A bad value is one line naming it (0, -1, x, 1,,2)."""
    hint = "give whole numbers >= 1 (requests denoised together), e.g. 1,2,4,8"
    try:
        sizes = parse_grid_values(str(spec), int)
    except UserError as e:  # "bad grid '1,,2': empty item between commas; use ..." -> the middle part
        why = str(e).split(": ", 1)[-1].split("; use a ")[0]
        raise UserError(f"--batch-size {spec!r}: {why}; {hint}") from None
    bad = [n for n in sizes if n < 1]
    if bad:
        raise UserError(f"--batch-size {spec!r}: {bad[0]} is not a batch size; {hint}")
    return sizes
