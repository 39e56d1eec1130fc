"""A rollout worker's receive strategies ("None", "Double", "Shared", "Sharded"): one endpoint
per strategy, `WorkerWeights` (what a worker keeps between syncs), its CUDA IPC channels and
the copy probes a cost model is calibrated with.
"""

from rlfleet.weightsync.endpoints._endpoint_worker import WorkerWeights
from rlfleet.weightsync.endpoints._endpoints import (
    DirectEndpoint,
    DoubleEndpoint,
    ShardedEndpoint,
    SharedEndpoint,
    TransportReceiver,
    WeightEndpoint,
    commit_consumer,
    create_endpoint,
)
from rlfleet.weightsync.endpoints._ipc_worker import IpcChannelReader, IpcChannelWriter
from rlfleet.weightsync.endpoints._probes import measure_copy_terms, probe_layout
from rlfleet.weightsync.endpoints._strategy import (
    WEIGHT_BUFFER_STRATEGIES,
    WeightBufferStrategy,
    check_strategy,
)

__all__ = [
    "WEIGHT_BUFFER_STRATEGIES",
    "DirectEndpoint",
    "DoubleEndpoint",
    "IpcChannelReader",
    "IpcChannelWriter",
    "ShardedEndpoint",
    "SharedEndpoint",
    "TransportReceiver",
    "WeightBufferStrategy",
    "WeightEndpoint",
    "WorkerWeights",
    "check_strategy",
    "commit_consumer",
    "create_endpoint",
    "measure_copy_terms",
    "probe_layout",
]
