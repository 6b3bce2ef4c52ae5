"""What a program run can raise: every error names the program line that made the failing call."""
from __future__ import annotations


class FrontendError(Exception):
    """A program could not run as written."""


class UnsupportedError(FrontendError):
    """The program asked for something this frontend does not do (an image, say)."""


class ServerError(FrontendError):
    """The server refused or failed a call; ``site`` is the program line that made it."""

    def __init__(self, message: str, *, status: int, site: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(f"{site}: the server answered {status}: {message}")
        self.status = status
        self.site = site
        self.param = param
        self.code = code
