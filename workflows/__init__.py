"""Parsl workflows for kfac-hpc sweeps, installed as ``kfac_hpc.workflows``.

This folder is also where users edit site configurations; see workflows/README.md.
"""
