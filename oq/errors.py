"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class OqError(Exception):
    """A problem with the user's input: model, calibration data, target or options."""


class PassError(OqError):
    """A pass failed or broke one of its declared checks; the message names the pass."""
