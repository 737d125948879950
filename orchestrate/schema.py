"""The base of every spec model: frozen, and strict about unknown keys.

Every field of the inventory and job files is a pydantic model deriving from ``Spec``, so a
misspelled key is an error (with a did-you-mean, see :mod:`orchestrate.loader`) instead of a
setting that is silently ignored.
"""

from pydantic import BaseModel, ConfigDict


class Spec(BaseModel):
    """A frozen model that rejects keys it does not know."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
