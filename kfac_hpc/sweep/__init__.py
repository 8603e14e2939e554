"""Scaling sweeps: a sweep spec becomes points, array scripts, a backend's jobs and a manifest.

Modules, one concept each, in import order (each imports only those above it; the backends'
Parsl workflows live in ``kfac_hpc.workflows``; tests/sweep/test_layering.py holds the order):

- ``errors``          the sweep's errors (bad input is a contracts InputError)
- ``safety``          validation and shell quoting of every user-provided string
- ``slurm_commands``  Slurm's commands (sbatch, squeue, sacct, scontrol, scancel), run and read
- ``spec``            the sweep definition (flags and/or TOML) and its expansion into points
- ``profile``         site profiles (partition, account, launcher, setup lines, environment)
- ``train_args``      a point's ``kfac-hpc train`` arguments and group hash
- ``job_checks``      every point checked by the job's own rules (the one seam to the job)
- ``render``          Jinja2 sbatch scripts, one per array
- ``manifest``        the on-disk source of truth of a sweep (atomic rewrites)
- ``prepare``         plan arrays, check, render: a prepared sweep, for every backend
- ``backends``        where points run: ``base`` (the interface), ``slurm``, ``local``,
                      ``pilot``, and the registry
- ``follow``          status, resume and cancel from the manifest, through the backend
- ``waiting``         the one wait loop (backoff 2 s to 60 s, reset on a change)
- ``progress_line``   the progress line of a sweep being followed
- ``cli``             the click commands ``sweep``, ``status``, ``resume``, ``cancel``
"""
