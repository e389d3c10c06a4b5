"""The bounds a flag's value must keep (one field's own range, declared on the field), and the
words of the error line that refuses a value outside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from imgtrainer.errors import UserError


@dataclass(frozen=True)
class Bound:
    """The values one flag accepts, ``low`` to ``high`` (an open end excludes itself), and what its
    error line says of them: ``--<flag> <says>, got <value>``."""

    low: float
    high: float = math.inf
    open_low: bool = False
    open_high: bool = False
    says: str = ""

    def allows(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def check(self, flag: str, value: float | None) -> None:
        """One error line for a value out of bounds; None (an optional flag left unset) passes."""
        if value is not None and not self.allows(value):
            raise UserError(f"--{flag} {self.says}, got {value}")


def interval(text: str, why: str = "") -> Bound:
    """A bound written as an interval, ``"(0, 1]"``; its error reads "must be in (0, 1] (why)"."""
    low, high = (float(end) for end in text[1:-1].split(","))
    says = f"must be in {text}" + (f" ({why})" if why else "")
    return Bound(low, high, text[0] == "(", text[-1] == ")", says)


POSITIVE = Bound(0, open_low=True, says="must be positive")
ZERO_OR_MORE = Bound(0, says="must be 0 or more")
OFF_OR_MORE = Bound(0, says="must be 0 (off) or more")
OFF_OR_POSITIVE = Bound(0, says="must be 0 (off) or positive")
AT_LEAST_1 = Bound(1, says="must be at least 1")
PROBABILITY = Bound(0, 1, says="is a probability in [0, 1]")
BETA_ALPHA = Bound(0, says="is a Beta alpha: 0 (off) or positive")
