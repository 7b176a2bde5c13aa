"""Environments the actors run episodes against, and their shared vocabulary."""
