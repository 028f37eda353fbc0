"""What a reload (SIGHUP, `systemctl reload dormouse`) can apply, and what it cannot.

A reload applies the sleep tiers' timers and the logging without touching a
model. Every other key is read once, at start: a model's context, its slots,
the port, the keys. A changed one used to be skipped without a word; now the
reload names each one ("needs a restart") in its log line and in systemd's
STATUS=, so `systemctl status dormouse` shows it.
"""

from __future__ import annotations

from typing import Any

RELOADABLE = frozenset({"sleep_idle_seconds", "drowsy_after", "deep_after", "log_level", "log_format"})
# Of a [models.ID] table, the keys a reload applies to that model.
RELOADABLE_PER_MODEL = frozenset({"sleep_idle_seconds", "drowsy_after", "deep_after"})


def _values(settings: Any, skip: frozenset[str]) -> dict[str, Any]:
    # model_dump() in Python mode keeps SecretStr objects, which compare by their secret:
    # a changed key counts as changed (in JSON mode every key reads "**********").
    return {k: v for k, v in settings.model_dump(exclude={"models"}).items() if k not in skip}


def needs_restart(running: Any, fresh: Any) -> list[str]:
    """The keys that differ between the running settings and the reloaded ones and that a reload
    does not apply: "ctx_size", "models.chat.parallel", "models.coder (added)"."""
    before, after = _values(running, RELOADABLE), _values(fresh, RELOADABLE)
    changed = [k for k in after if before.get(k) != after[k]]
    for model_id in running.models.keys() | fresh.models.keys():
        old, new = running.models.get(model_id), fresh.models.get(model_id)
        if old is None or new is None:
            changed.append(f"models.{model_id} ({'added' if old is None else 'removed'})")
            continue
        old_values, new_values = old.model_dump(), new.model_dump()
        changed += [f"models.{model_id}.{k}" for k in new_values
                    if k not in RELOADABLE_PER_MODEL and old_values.get(k) != new_values[k]]
    return sorted(changed)
