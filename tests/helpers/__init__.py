"""Helpers shared by the tests (imported as ``helpers.<module>``; no test module imports
another test module)."""
