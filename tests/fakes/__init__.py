"""Fakes shared by the tests (a stateful `pynvml` stand-in)."""
