"""`python -m kfac_hpc` is the same as the `kfac-hpc` command."""

from kfac_hpc.cli import main

main()
