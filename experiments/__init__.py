"""Reproductions of the seeds' tables and figures (application layer). Run ``python -m cde_nets.experiments --help``."""
