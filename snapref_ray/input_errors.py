"""One typed input error: what was wrong, and where, as fields a door reads instead of parsing messages.

An input is checked where it is read (a manifest row, a Ray Data row, an HTTP request, a flag, a reference
file); the error raised there names the field and the file it found at fault, and the door that reads many
inputs adds which one (`index`). A door that words the failure its own way (a flag name, a column, a row's
error) takes these fields; the message a user sees is the error's own and stays as it is.
"""

from __future__ import annotations


class InputError(ValueError):
    """An input that cannot be rendered.

    `reason` is what is wrong, without where; `field` the column, flag or request field at fault (None when
    no one is); `source` the file or URI at fault (None when no one is); `index` which manifest row, batch
    row or request it was (None until a door that reads several sets it with `at`).
    """

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        field: str | None = None,
        source: str | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason
        self.field = field
        self.source = source
        self.index = index

    def at(self, index: int) -> InputError:
        """This error, placed at the door's input number `index`."""
        self.index = index
        return self
