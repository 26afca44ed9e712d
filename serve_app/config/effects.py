"""What each config key does here, declared on the key itself: it acts, it has no effect here, or
it is refused.

MindIE's config.json carries keys that this server has no counterpart for (ports of its own
processes, scheduler knobs of its C++ scheduler). Accepting them silently would let a user
believe they hold, so every field's `Field(json_schema_extra=...)` says one of:

    acts()                     the key changes what the server does
    no_effect(note, when=...)  accepted, and one warning per load when the user set it (to a
                               value matching `when`, if given) saying why and what to do instead
    refused(note, when=...)    a load error naming the key and the alternative

`Section` (the base of every config model) refuses at validation time, so a refusal is listed
with every other problem of the config; `no_effect_warnings` walks a loaded config for the
warnings (`load_config` logs them); `serve_app.config.reference` renders the same metadata as
the status column of docs/configuration.md. One declaration feeds all three.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

ACTS, NO_EFFECT, REFUSED = "acts", "no-effect", "refused"
_OPS = {"==": operator.eq, ">": operator.gt}


def acts() -> dict[str, Any]:
    return {"effect": ACTS}


def no_effect(note: str, when: tuple[str, Any] | None = None, message: str = "") -> dict[str, Any]:
    """note: why the key does nothing here and what to use instead. when: (op, value), the
    values that have no effect (others act); None: any value. message: the warning in full, a
    template with {path} and {value}, where the usual wording does not fit."""
    return _effect(NO_EFFECT, note, when, message=message)


def refused(note: str, when: tuple[str, Any] | None = None) -> dict[str, Any]:
    """note: why the key cannot be honoured and what to use instead. when: as for no_effect."""
    return _effect(REFUSED, note, when)


def _effect(kind: str, note: str, when: tuple[str, Any] | None, **more: str) -> dict[str, Any]:
    assert when is None or when[0] in _OPS, when
    extra: dict[str, Any] = {"effect": kind, "note": note, **{k: v for k, v in more.items() if v}}
    if when is not None:
        extra["when"] = list(when)  # JSON-friendly: the metadata also lands in the JSON schema
    return extra


@dataclass(frozen=True)
class Effect:
    kind: str  # ACTS, NO_EFFECT or REFUSED
    note: str = ""
    when: tuple[str, Any] | None = None
    message: str = ""

    def applies(self, value: Any) -> bool:
        """Whether `value` is one the no-effect / refused status is about."""
        if self.when is None:
            return True
        op, bound = self.when
        return _OPS[op](value, bound)

    def warning(self, path: str, value: Any) -> str:
        # where only some values have no effect, the line says which one was set
        usual = "{path} ({value}) has no effect here: {note}"
        if self.when is None:
            usual = "{path} has no effect here: {note}"
        template = self.message or usual
        return template.format(path=path, value=show(value), note=self.note)


def effect_of(field: FieldInfo) -> Effect | None:
    """The field's declared status; None when it declares none (a bug the tests catch)."""
    extra = field.json_schema_extra
    if not isinstance(extra, dict) or extra.get("effect") not in (ACTS, NO_EFFECT, REFUSED):
        return None
    when = extra.get("when")
    return Effect(
        str(extra["effect"]),
        str(extra.get("note", "")),
        None if when is None else (when[0], when[1]),
        str(extra.get("message", "")),
    )


def show(value: Any) -> str:
    """A value as the user wrote it in YAML/JSON: true, not True."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


class Section(BaseModel):
    """Base of every config model: frozen, unknown keys refused, refused values refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Runs on the values a user gave (pydantic validates no defaults), after their type checks,
    # so the error's location is the key's own dotted path.
    @field_validator("*")
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        effect = effect_of(cls.model_fields[info.field_name])
        if effect is not None and effect.kind == REFUSED and effect.applies(value):
            raise ValueError(f"{show(value)} is refused: {effect.note}")
        return value


def no_effect_warnings(section: BaseModel, path: str = "") -> list[str]:
    """One line per key the user set (model_fields_set, in every nested section) whose value has
    no effect here; keys left at their defaults never warn."""
    lines = []
    for name, field in type(section).model_fields.items():
        if name not in section.model_fields_set:
            continue
        value, where = getattr(section, name), f"{path}.{name}" if path else name
        effect = effect_of(field)
        if effect is not None and effect.kind == NO_EFFECT and effect.applies(value):
            lines.append(effect.warning(where, value))
        if isinstance(value, BaseModel):
            lines += no_effect_warnings(value, where)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    lines += no_effect_warnings(item, f"{where}[{i}]")
    return lines
