"""Reproductions of the seeds' tables and figures (application layer). Run ``python -m experiments --help``."""
