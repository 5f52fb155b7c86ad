"""Reliability and security hardening (issue 23): one test file per item."""
