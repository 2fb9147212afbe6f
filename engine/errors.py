"""What the engine refuses: its one error type for bad input, a leaf module every room
may import (the gateway turns it into a 400 naming the field)."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses; `field` names the offending parameter."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # crosses a process boundary (the engine core's pipe) intact
        return InvalidRequest, (self.field, self.message)
