"""Sweep grids: one axis spec (`8,16,32`, `8-48+8`, `0.05-0.2+0.05`, mixes) -> its values, and the lists of
counts in that syntax (`--batch-size`, `--concurrency`). Must not: know about cells, models or measuring.
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
    """A sweep axis's values (`kind` int or float), duplicates dropped. Ranges are inclusive and computed in decimal
    arithmetic, so 0.05-0.2+0.05 gives exactly [0.05, 0.1, 0.15, 0.2]. A bad spec is a `UserError` quoting it."""
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


def parse_counts(spec: str, flag: str, noun: str, what: str, example: str) -> list[int]:
    """Whole numbers >= 1 in grid syntax, in the order given, duplicates dropped; a bad value is one line naming
    `flag` and it (0, -1, x, 1,,2)."""
    hint = f"give whole numbers >= 1 ({what}), e.g. {example}"
    try:
        values = parse_grid_values(str(spec), int)
    except UserError as e:  # "bad grid '1,,2': empty item between commas; use ..." -> the middle part
        why = str(e).split(": ", 1)[-1].split("; use a ")[0]
        raise UserError(f"{flag} {spec!r}: {why}; {hint}") from None
    bad = [n for n in values if n < 1]
    if bad:
        raise UserError(f"{flag} {spec!r}: {bad[0]} is not {noun}; {hint}")
    return values


def parse_batch_sizes(spec: str) -> list[int]:
    """`--batch-size 1,2,4,8` (bench and sweep)."""
    return parse_counts(spec, "--batch-size", "a batch size", "requests denoised together", "1,2,4,8")
