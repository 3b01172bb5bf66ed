"""Checking refusals: the error names what it should."""

import pytest


def assert_refused(error, call, fragments):
    """``call()`` raises ``error`` (a type or a tuple of types) whose message holds every one of
    ``fragments``; the message is shown when one is missing."""
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
