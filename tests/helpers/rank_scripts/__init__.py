"""Programs the multi-rank tests start as real ranks (``python SCRIPT`` under mpiexec); each
ends the whole job at once when it fails (tests/helpers/rank_checks.py)."""
