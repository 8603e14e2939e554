"""The Jinja2 sbatch template, installed as ``kfac_hpc.templates``."""
