"""Shared report writing and statistics for every benchmark."""
