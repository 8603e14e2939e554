"""``kfac-hpc plan``: predicted step time per phase and memory per rank, before the sweep.

layers (what the model is) → compute (seconds per layer operation) + alphabeta/placement/
profiles (seconds per collective, by algorithm and where its ranks sit) → model (one step of
one configuration) → planner/output/cli; site (``plan calibrate``) writes a profile.
"""
