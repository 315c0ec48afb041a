"""The base of every campaign spec section (its own module so section modules can share it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value, info: ValidationInfo):
        """YAML's ``true`` is not a number: a bool for an int or float field is refused, not read as 1."""
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation in (int, float):
            raise ValueError(f"expected a number, got {str(value).lower()} (a number is not a boolean)")
        return value
