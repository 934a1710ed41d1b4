"""Worker-side pieces: load-event publisher, simulated engine, admission (SPEC §3, §6)."""
