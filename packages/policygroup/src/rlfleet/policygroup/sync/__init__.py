"""The executor of rlfleet.placement's sync plan on Ray: the workers as the plan's processes,
the wiring a plan needs (node buffers, endpoints, communication groups), the calls each step
becomes, and one weight sync with its retry, rolling apply and `SyncReport`; non-blocking syncs
(`BackgroundSyncs`: the trainers' snapshot now, the rest in the background, newest first).
"""

from rlfleet.policygroup.sync._background import BackgroundSyncs
from rlfleet.policygroup.sync._weight_sync import SyncOutcome, WeightSync

__all__ = ["BackgroundSyncs", "SyncOutcome", "WeightSync"]
