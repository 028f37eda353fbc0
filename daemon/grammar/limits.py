"""What one request's grammar may cost, counted while its schemas are walked,
before anything is converted.

Two costs matter. Building: the schemas are converted on a thread (off the
event loop, see off_loop.py), and the counts below keep that to milliseconds.
Matching: llama.cpp's grammar matcher keeps a parse stack per way the output
can go on, and at a step whose sampled token the grammar refuses it checks the
whole vocabulary against each stack, on the thread that decodes every slot
(measured: 18 ms plus 1.6 ms per stack for Gemma 3's 262k tokens on one core).
width.py bounds what all of a grammar's alternatives add up to; objects.py and
literals.py write names and enums as prefix trees so that their number does
not count there, only how differently they begin. What their number still
costs is grammar size and build time, bounded here.

The figures are far above what clients send: the openai SDK's strict schemas
make every property required, OpenAI itself accepts at most 5000 properties,
1000 enum values and 10 levels of nesting, and a pydantic model with more than
128 optional fields is rare. A request over one is refused with a 400 that
names the limit.
"""

from __future__ import annotations

import time

MAX_OPTIONAL_PROPERTIES = 128  # in one object: each adds a copy of its path in the names' tree (objects.py)
MAX_PROPERTIES = 5000  # in all the schemas of one request (OpenAI's own limit)
MAX_ALTERNATIVES = 256  # anyOf/oneOf alternatives and type lists, in all the schemas of one request
MAX_ENUM_VALUES = 4096  # enum and const values, in all the schemas of one request
MAX_LITERAL_BYTES = 128 * 1024  # the JSON spellings of those values, together
MAX_LIVE_STACKS = 64  # parse stacks the matcher may hold at one point (width.py): ~120 ms per refused step
BUILD_SECONDS = 2.0  # building one request's grammar, walk and conversion
MAX_REPEAT = 1000  # one minItems/maxItems/minLength/maxLength or {n,m}: expanded rule by rule
MAX_REPEAT_TOTAL = 10_000  # all of them in one request, so building stays cheap


class LimitExceeded(ValueError):
    """A count is over its limit; the message says which and by how much."""


class BuildTimeout(LimitExceeded):
    pass


class Deadline:
    """When a build must be over: `seconds` from now."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.at


class Spending:
    """The counts of one request, across every schema it converts, and the
    deadline of its build (None: no time bound)."""

    def __init__(self, deadline: Deadline | None = None) -> None:
        self.deadline = deadline
        self.properties = 0
        self.alternatives = 0
        self.values = 0
        self.literal_bytes = 0

    def check_time(self) -> None:
        if self.deadline is not None and self.deadline.passed():
            raise BuildTimeout(f"building its grammar took longer than {self.deadline.seconds:g}s")

    def object(self, n_properties: int, n_optional: int) -> None:
        if n_optional > MAX_OPTIONAL_PROPERTIES:
            raise LimitExceeded(f"{n_optional} optional properties in one object; at most {MAX_OPTIONAL_PROPERTIES} "
                                "are accepted (required ones are not limited: list them in required, nullable "
                                "if need be, as OpenAI's strict schemas do)")
        self.properties += n_properties
        if self.properties > MAX_PROPERTIES:
            raise LimitExceeded(f"more than {MAX_PROPERTIES} properties in all the schemas of the request")

    def choice(self, n_alternatives: int) -> None:
        self.alternatives += n_alternatives
        if self.alternatives > MAX_ALTERNATIVES:
            raise LimitExceeded(f"more than {MAX_ALTERNATIVES} anyOf/oneOf alternatives and types in all the schemas "
                                "of the request")

    def literals(self, spellings: list[str]) -> None:
        self.values += len(spellings)
        self.literal_bytes += sum(len(s.encode("utf-8", errors="surrogatepass")) for s in spellings)
        if self.values > MAX_ENUM_VALUES:
            raise LimitExceeded(f"more than {MAX_ENUM_VALUES} enum and const values in all the schemas of the request")
        if self.literal_bytes > MAX_LITERAL_BYTES:
            raise LimitExceeded(f"enum and const values of more than {MAX_LITERAL_BYTES} bytes in all the schemas of "
                                "the request")
