"""The two kinds of failure: the user's (fixable input) and oq's own (a bug)."""


class OqError(Exception):
    """A problem with the user's input: model, calibration data, target or options. The CLI prints it as one line
    and exits with code 2."""


class InternalError(Exception):
    """A bug in oq: a pass crashed or broke its declared contract. Never dressed as a user error: the CLI says so,
    names the pass, exits with code 1 and shows the traceback with --debug."""

    def __init__(self, message: str, pass_name: str | None = None):
        super().__init__(message)
        self.pass_name = pass_name


class PassError(InternalError):
    """A pass failed or broke one of its declared checks; the message names the pass."""
