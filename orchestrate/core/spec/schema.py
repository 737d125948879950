"""The base of every spec model: frozen, and strict about unknown keys.

Every field of the inventory and job files is a pydantic model deriving from ``Spec``, so a
misspelled key is an error (with a did-you-mean, see :mod:`orchestrate.core.spec.loader`) instead of
a setting that is silently ignored.
"""

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """A frozen model that rejects keys it does not know."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def single_line(value: str) -> str:
    """Refuse line breaks and control characters in a value that must stay on one line.

    Slurm settings end up in ``#SBATCH`` lines, which sbatch reads line by line: a line break
    would end the option there and turn the rest into shell code.
    """
    if not value.isprintable():
        raise ValueError("a line break or control character cannot go into an #SBATCH line")
    return value
