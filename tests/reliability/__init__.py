"""Reliability and security hardening: one test file per failure mode (a hostile or careless input, a
kill, a full disk, a damaged file), each ending in one line and nothing half-done."""
