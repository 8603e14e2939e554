"""The training job ``kfac-hpc train``: config -> model + data + optimizer -> loop -> records.

Kept import-light: ``kfac_hpc.train.config`` needs no torch. The run directory's layout and
the options' metadata live in :mod:`kfac_hpc.contracts`.
"""
