"""Every setting says what it does (issue 30): the generated reference
(docs/reference/configuration.md) takes each key's description from the
schema, and a key without one showed an empty cell."""

import re

from config.models import ModelSettings
from config.settings import Settings
from daemon import config_reference


def test_every_top_level_key_has_a_one_line_description():
    missing = [key for key, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"Settings fields without a description: {missing}"
    multi = [key for key, field in Settings.model_fields.items() if "\n" in field.description]
    assert not multi, f"descriptions on more than one line (a table cell is one): {multi}"


def test_every_models_table_key_has_its_own_or_the_top_level_description():
    top = Settings.model_fields
    missing = [key for key, field in ModelSettings.model_fields.items()
               if not (field.description or (key in top and top[key].description))]
    assert not missing, f"[models.ID] keys with no description of their own nor a top-level one: {missing}"


def test_no_row_of_the_generated_reference_has_an_empty_description():
    page = config_reference.render()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) >= len(Settings.model_fields)
    empty = [row.split("|")[1].strip() for row in rows if not re.split(r"(?<!\\)\|", row)[-2].strip()]
    assert not empty, f"keys shown with no description: {empty}"
