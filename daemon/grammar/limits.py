"""What one request's structured output may cost, counted before llguidance
compiles anything.

llguidance bounds its own matching: its Earley parser stops at 2000 items per
row and at its lexer fuel, and the matcher then errors instead of stalling
(the worker turns that into the request's error). What it does not bound is
compile time and memory, which grow with the schema: 12 forced tools of 900
optional properties each took 1.8-6.7 s to compile on the development box
(docs/structured-output-engines.md, section 5), and a schema object of 990
optional properties compiles, then errors at its first token. So the sizes
below are still counted, while the schema is checked (schema_check.py).

The figures are far above what clients send: the openai SDK's strict schemas
make every property required, OpenAI itself accepts at most 5000 properties,
1000 enum values and 10 levels of nesting. A request over one is refused with
a 400 that names the limit.
"""

from __future__ import annotations

import time

MAX_SCHEMA_BYTES = 64 * 1024  # one schema, as compact JSON
MAX_SCHEMA_DEPTH = 32  # schemas within schemas; llguidance's compiler recurses on them
# In one object. llguidance compiles 200 into a grammar whose rows stay under its
# 2000-item bound; 990 errors at the first token ("row has 3967 items").
MAX_OPTIONAL_PROPERTIES = 256
MAX_PROPERTIES = 5000  # in all the schemas of one request (OpenAI's own limit)
MAX_ENUM_VALUES = 4096  # enum and const values, in all the schemas of one request
MAX_LITERAL_BYTES = 128 * 1024  # the JSON spellings of those values, together
BUILD_SECONDS = 2.0  # checking and compiling one request's grammar


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
    """The counts of one request, across every schema it compiles, and the
    deadline of its build (None: no time bound)."""

    def __init__(self, deadline: Deadline | None = None) -> None:
        self.deadline = deadline
        self.properties = 0
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

    def literals(self, spellings: list[str]) -> None:
        self.values += len(spellings)
        self.literal_bytes += sum(len(s.encode("utf-8", errors="surrogatepass")) for s in spellings)
        if self.values > MAX_ENUM_VALUES:
            raise LimitExceeded(f"more than {MAX_ENUM_VALUES} enum and const values in all the schemas of the request")
        if self.literal_bytes > MAX_LITERAL_BYTES:
            raise LimitExceeded(f"enum and const values of more than {MAX_LITERAL_BYTES} bytes in all the schemas of "
                                "the request")
