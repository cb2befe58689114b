"""Scale-out: the distributed H2-DNN across processes, data-parallel training helpers (DDP) and a local process
launcher (torch.distributed)."""

from . import data_parallel
from .exchange import Comm, exchange
from .h2 import NodeH2, centralised_h2, h2_masks, h2_node_worker, neighbours, run_h2
from .launch import spawn

__all__ = [
    "Comm",
    "exchange",
    "NodeH2",
    "centralised_h2",
    "h2_masks",
    "neighbours",
    "h2_node_worker",
    "run_h2",
    "spawn",
    "data_parallel",
]
