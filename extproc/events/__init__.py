"""The event plane: worker load events over ZeroMQ (SPEC §3)."""
