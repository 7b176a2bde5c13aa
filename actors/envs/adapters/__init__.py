"""Environments written for other frameworks, run as CompactionRL environments."""
