"""The one door to the network, and the ledger of every byte that goes through it.

- :mod:`~zeropp.comm.communicator`: ``Communicator``, the only caller of torch.distributed
  collectives (``Pending`` handles, collective time-outs named in one line);
- :mod:`~zeropp.comm.ledger`: the ledger and its byte model;
- :mod:`~zeropp.comm.observed`: DTensor's own collectives, seen and recorded in the ledger;
- :mod:`~zeropp.comm.quantized`: qwZ's quantized all-gather and qgZ's two-hop all-to-all;
- :mod:`~zeropp.comm.feedback`: qgZ's LoCo error feedback (per-rank residuals).
"""

from zeropp.comm.communicator import CollectiveTimeout, Communicator, PeerLost, Pending
from zeropp.comm.ledger import Ledger

__all__ = ["CollectiveTimeout", "Communicator", "Ledger", "Pending", "PeerLost"]
