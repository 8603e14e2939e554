"""Jinja2 sbatch templates and site profiles, installed as ``kfac_hpc.templates``."""
