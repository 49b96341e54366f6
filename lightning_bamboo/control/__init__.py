"""Processes and store protocols outside training (no Lightning)."""
