"""The event plane: worker load events over ZeroMQ (docs/events.md)."""
