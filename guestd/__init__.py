"""guestd: the in-guest agent of a microVM sandbox, and its host-side client."""

__version__ = "0.1.0"
