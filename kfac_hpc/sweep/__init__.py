"""Scaling sweeps: a sweep spec becomes points, Slurm array scripts, submissions and a manifest.

Modules, one concept each:

- ``errors``     the one exception for bad user input (field + fix, exit 2)
- ``safety``     validation and shell quoting of every user-provided string
- ``spec``       the sweep definition (flags and/or TOML) and its expansion into points
- ``profile``    site profiles (partition, account, launcher, setup lines, environment)
- ``render``     Jinja2 sbatch scripts, one per Slurm array
- ``slurm``      thin wrappers around sbatch / squeue / scontrol / scancel
- ``manifest``   the on-disk source of truth of a sweep (atomic rewrites)
- ``submit``     plan arrays, render everything, then submit (or dry-run)
- ``follow``     status, resume and cancel from the manifest
- ``commands``   the click commands ``sweep``, ``status``, ``resume``, ``cancel``
"""
