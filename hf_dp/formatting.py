"""Numbers as text, in one place: the privacy card, `hf-dp publish`, the `hf-dp plan` table and the app.

[`format_number`] is the one cell formatter (missing values, NaN and infinity spelled the same way everywhere);
[`format_epsilon`] is the one way a spent ε is shown (rounded up, two decimals: card, logs, tables, app, plots);
[`format_upper_bound`], [`format_lower_bound`] and [`format_significant`] round in the direction that never
flatters the guarantee (ε up, a lower bound down, δ and q up, σ down) before formatting.

```python
>>> from hf_dp.formatting import format_number, format_upper_bound, format_significant
>>> format_number(0.123456), format_number(None), format_number(float("inf")), format_number(25625)
('0.1235', '–', '∞', '25625')
>>> format_upper_bound(7.981, 2), format_significant(1.2345e-4, 2, up=True)
('7.99', '0.00013')
```
"""
from __future__ import annotations

import math
import numbers
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

__all__ = ["MISSING", "format_epsilon", "format_lower_bound", "format_number", "format_significant",
           "format_upper_bound", "rounded"]

MISSING = "–"  # what a table shows for a missing number


def format_number(value: Any, spec: str = ".4g", missing: str = MISSING) -> str:
    """`value` formatted with `spec`: `missing` for None or NaN, `∞` / `-∞` for infinities.

    Integers are counts: a general format (`.4g`, `g`) prints them whole, never `2.562e+04`; other specs apply
    (`d`, `,`, `.1f`). Booleans and anything that is not a real number are printed with `str`.
    """
    if value is None:
        return missing
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):  # a count: general formats (".4g") would round it, print it whole
        return format(value, "d") if spec[-1:] in "gG" else format(value, spec)
    value = float(value)
    if math.isnan(value):
        return missing
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    return format(value, spec)


def rounded(value: Any, exponent: int | None, up: bool, digits: int | None = None) -> Any:
    """`value` rounded up (or down) to a multiple of 10**exponent, or to `digits` significant figures.

    Exact in decimal (from the shortest decimal that is the float); anything but a finite non-zero real number
    comes back unchanged.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value == 0:
        return value
    exact = Decimal(repr(float(value)))  # the shortest decimal that is this float
    if digits is not None:
        exponent = exact.adjusted() - digits + 1
    return float(exact.quantize(Decimal(1).scaleb(exponent), rounding=ROUND_CEILING if up else ROUND_FLOOR))


def format_upper_bound(value: Any, decimals: int, missing: str = MISSING) -> str:
    """Round an upper bound *up*, so a card never shows a smaller ε than was accounted."""
    return format_number(rounded(value, -decimals, up=True), f".{decimals}f", missing)


def format_epsilon(value: Any, missing: str = MISSING) -> str:
    """The one way hf_dp shows a spent (or computed) ε: rounded *up* to two decimals, as the card states it, so no
    table, log line, plot or page shows less than was spent (7.9946 reads 8.00, never 7.99).

    >>> format_epsilon(7.9946), format_epsilon(0.5), format_epsilon(None), format_epsilon(float("inf"))
    ('8.00', '0.50', '–', '∞')
    """
    return format_upper_bound(value, 2, missing)


def format_lower_bound(value: Any, decimals: int, missing: str = MISSING) -> str:
    """Round a lower bound *down*, so the stated interval always contains the accountant's."""
    return format_number(rounded(value, -decimals, up=False), f".{decimals}f", missing)


def format_significant(value: Any, digits: int, up: bool, missing: str = MISSING) -> str:
    """`digits` significant figures, rounded up (δ, q) or down (σ): in the direction that never flatters ε."""
    return format_number(rounded(value, None, up=up, digits=digits), f".{digits}g", missing)
