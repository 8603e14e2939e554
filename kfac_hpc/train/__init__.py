"""The training job ``kfac-hpc train``: config -> model + data + optimizer -> loop -> records.

Kept import-light: ``kfac_hpc.train.config`` and ``kfac_hpc.train.rundir`` need no torch, so
the sweep and the collector can use the field names and the run-directory checker.
"""
