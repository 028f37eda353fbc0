"""The structured-output benchmark's own data and helpers (bench/structured_*.py):
its keyword cases must say the truth about JSON Schema, or its coverage table
would blame an engine for the case's mistake."""

import jsonschema
import numpy as np
import pytest

from bench.structured_adapters import bits_to_bool
from bench.structured_schemas import CASES


def _validator(schema):
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name,schema,good,bad", CASES, ids=[c[0] for c in CASES])
def test_case_values_are_what_they_claim(name, schema, good, bad):
    jsonschema.Draft202012Validator.check_schema(schema)
    assert good and bad, "each case needs values that match and values that must not"
    for value in good:
        assert _validator(schema).is_valid(value), f"{name}: {value!r} should match"
    checkable = "format" not in schema or schema["format"] in jsonschema.FormatChecker().checkers
    for value in bad if checkable else []:
        assert not _validator(schema).is_valid(value), f"{name}: {value!r} should not match"


def test_bitmask_bits_map_to_token_ids():
    n_vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed = {0, 1, 31, 32, 63, 64, 69}
    words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    for token in allowed:
        words.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))
    mask = bits_to_bool(words, n_vocab)
    assert mask.shape == (n_vocab,)
    assert set(np.flatnonzero(mask).tolist()) == allowed
