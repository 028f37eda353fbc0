"""The server-wide sampling defaults' types (llama-server's -n, -s, --temp, --top-k, ...): the bounds a request's own
field has (daemon/http/core/schemas.py), shared by the top level (config/settings.py) and a [models.ID] table
(config/models.py), whose values win for its model."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field


def _some_tokens(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("0 predicts nothing: give at least 1, or -1 for until the end")
    return value


NPredict = Annotated[int, Field(ge=-1, le=1_000_000), AfterValidator(_some_tokens)]
Seed = Annotated[int, Field(ge=-1, le=2**32 - 1)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopK = Annotated[int, Field(ge=-1, le=2**31 - 1)]  # 0 or -1: off (llama-server's and vLLM's -1)
TopP = Annotated[float, Field(ge=0.0, le=1.0)]  # 1: off; 0: the most probable token only, as in llama.cpp
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
RepeatPenalty = Annotated[float, Field(gt=0.0, le=10.0)]
RepeatLastN = Annotated[int, Field(ge=-1, le=2**31 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # presence and frequency

# The sampling defaults a [models.ID] table may set (the settings of the same names).
SAMPLING_KEYS = ("n_predict", "seed", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                 "presence_penalty", "frequency_penalty")
