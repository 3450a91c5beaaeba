"""Benchmark utilities: the copy-bandwidth roofline, event timing, JSON output."""
