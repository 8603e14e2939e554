"""Site profiles shipped with kfac-hpc (``--profile NAME``), installed as
``kfac_hpc.site_profiles``; examples of a site's own profile are in ``slurm/profiles/``."""
