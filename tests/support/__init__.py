"""Helpers shared by the server-backed tests."""
