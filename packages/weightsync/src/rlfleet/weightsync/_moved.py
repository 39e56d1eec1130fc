"""Names that moved from rlfleet.weightsync to rlfleet.policygroup (a policy worker's own
surface): still importable from rlfleet.weightsync for one release, with a DeprecationWarning
naming the new home. The face imports this module's `__getattr__` (PEP 562).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: name -> the module it is imported from now
MOVED_TO_POLICYGROUP: dict[str, str] = {
    "BufferSettings": "rlfleet.policygroup.worker",
    "Checkpoints": "rlfleet.policygroup.worker",
    "CommGroupCalls": "rlfleet.policygroup.worker",
    "DeviceCalls": "rlfleet.policygroup.worker",
    "EngineRefit": "rlfleet.policygroup.nemo",
    "OffloadCalls": "rlfleet.policygroup.worker",
    "ParallelMode": "rlfleet.policygroup.worker",
    "Profiler": "rlfleet.policygroup.worker",
    "ReferenceCalls": "rlfleet.policygroup.worker",
    "RefitCalls": "rlfleet.policygroup.nemo",
    "RefitChannel": "rlfleet.policygroup.nemo",
    "ReshardCalls": "rlfleet.policygroup.nemo",
    "RolloutEngines": "rlfleet.policygroup.nemo",
    "StateCalls": "rlfleet.policygroup.worker",
    "Timings": "rlfleet.policygroup.worker",
    "WeightCalls": "rlfleet.policygroup.worker",
    "WorkerCalls": "rlfleet.policygroup",
    "WorkerComm": "rlfleet.policygroup.worker",
    "WorkerHost": "rlfleet.policygroup.worker",
    "WorkerSettings": "rlfleet.policygroup.worker",
    "device_id": "rlfleet.policygroup.worker",
    "device_info": "rlfleet.policygroup.worker",
    "free_memory": "rlfleet.policygroup.worker",
    "host_memory": "rlfleet.policygroup.worker",
    "import_zmq": "rlfleet.policygroup.nemo",
    "reference_logprobs": "rlfleet.policygroup.worker",
    "reset_peak_memory": "rlfleet.policygroup.worker",
    "transport_state": "rlfleet.policygroup.nemo",
}


def __getattr__(name: str) -> Any:
    home = MOVED_TO_POLICYGROUP.get(name)
    if home is None:
        raise AttributeError(f"module 'rlfleet.weightsync' has no attribute {name!r}")
    warnings.warn(
        f"rlfleet.weightsync.{name} moved to {home}.{name}; import it from there "
        "(the old name goes away in the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    try:
        # by name, not an import statement: weightsync never depends on policygroup
        module = importlib.import_module(home)
    except ImportError as exc:
        raise ImportError(
            f"rlfleet.weightsync.{name} moved to {home}.{name}: install rlfleet-policygroup"
        ) from exc
    return getattr(module, name)
