"""``kfac-hpc plan``: predicted step time per phase and memory per rank, before the sweep.

layers (what the model is) → compute (seconds per layer operation) + alphabeta/profiles
(seconds per collective) → model (one step of one configuration) → planner/output/cli.
"""
