"""FOSI and its distributed design DHO2: a hybrid-order optimizer around any base optimizer.

``FOSI`` (optimizer.py) composes: HVPs by autodiff (hvp.py), sharded Lanczos (lanczos.py),
coordinate sharding (sharding.py), the parameters as views of one flat buffer (flat_params.py),
the ZeRO-1 base optimizer (sharded_base.py) and curvature ranks pipelined with training
(pipeline.py). docs/fosi.md explains the algorithm and options.
"""

from kfac_hpc.optim.fosi.lanczos import NonFiniteCurvature
from kfac_hpc.optim.fosi.optimizer import FOSI
from kfac_hpc.optim.fosi.options import FOSIOptions

__all__ = ["FOSI", "FOSIOptions", "NonFiniteCurvature"]
