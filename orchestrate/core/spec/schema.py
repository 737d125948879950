"""The base of every spec model: frozen, strict about unknown keys, and about numbers.

Every field of the inventory and job files is a pydantic model deriving from ``Spec``, so a
misspelled key is an error (with a did-you-mean, see :mod:`orchestrate.core.spec.loader`) instead of
a setting that is silently ignored.

Numbers and switches are strict too (fields use :data:`Int`, :data:`Float`, their ``Maybe``
forms and :data:`Bool`, never bare ``int``/``float``/``bool``; tests/core/test_core_strict_values.py
walks every field):
pydantic would take ``cpus: true`` as 1 and ``sidecar: yes`` as true, and YAML's ``1e999`` or
``.inf`` as infinity, which JSON (``plan --json``, ``train.json``, the store) cannot hold. Text
that spells a number (``lr: 1e-3``, which YAML leaves a string) is still read as that number.
"""

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool


class Spec(BaseModel):
    """A frozen model that rejects keys it does not know, and inf or nan in any float."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True,
                              allow_inf_nan=False)


def not_boolean(what: str) -> BeforeValidator:
    """Refuse true/false where ``what`` (a number, or a number or a word) is wanted: YAML's
    ``true`` is no count, and pydantic alone would read it as 1."""

    def check(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"{what}, not true/false")
        return value

    return BeforeValidator(check)


#: A whole number; true/false refused.
Int = Annotated[int, not_boolean("a whole number")]
#: A finite number (inf and nan refused by :class:`Spec`); true/false refused.
Float = Annotated[float, not_boolean("a number")]
#: :data:`Int` or nothing. The check wraps the whole ``int | None``: ``Field(ge=1)`` then
#: still reaches the number (and the JSON Schema says ``minimum``, not pydantic's ``ge``).
MaybeInt = Annotated[int | None, not_boolean("a whole number")]
#: :data:`Float` or nothing (as :data:`MaybeInt`).
MaybeFloat = Annotated[float | None, not_boolean("a number")]
#: true or false only: not yes/no/on/off (text in these files), not 1/0.
Bool = StrictBool


def finite_values(value: Any) -> Any:
    """Refuse inf and nan anywhere inside free-form values (``model_args``): they reach the
    ranks as JSON, which has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"inf and nan are not numbers JSON can carry (got {value})")
    if isinstance(value, dict):
        for item in value.values():
            finite_values(item)
    elif isinstance(value, list | tuple):
        for item in value:
            finite_values(item)
    return value


def single_line(value: str) -> str:
    """Refuse line breaks and control characters in a value that must stay on one line.

    Slurm settings end up in ``#SBATCH`` lines, which sbatch reads line by line: a line break
    would end the option there and turn the rest into shell code.
    """
    if not value.isprintable():
        raise ValueError("a line break or control character cannot go into an #SBATCH line")
    return value
