"""NeMo RL's worker surface, Ray-free: the refit (a control channel over ZMQ with the `[zmq]`
extra, and a refit collective with rollout engines) and the ``nccl_reshard`` calls (groups,
planning with rlfleet.placement, transfer and refit), as mixins over `WorkerHost`.
"""

from rlfleet.policygroup.nemo._engines import EngineRefit, RolloutEngines
from rlfleet.policygroup.nemo._refit_calls import RefitCalls, transport_state
from rlfleet.policygroup.nemo._refit_channel import RefitChannel, connect_refit_engine, import_zmq
from rlfleet.policygroup.nemo._reshard_calls import ReshardCalls, ReshardState

__all__ = [
    "EngineRefit",
    "RefitCalls",
    "RefitChannel",
    "ReshardCalls",
    "ReshardState",
    "RolloutEngines",
    "connect_refit_engine",
    "import_zmq",
    "transport_state",
]
