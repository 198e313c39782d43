"""The error of a data file that does not follow its schema, apart from the schema's checks
(schema.py) so that the image checks they call (images.py) raise it too."""

from __future__ import annotations

from hybridflow.errors import UserError


class DataSchemaError(UserError, ValueError):
    """A data file does not follow the expected schema; the message says where and why."""
