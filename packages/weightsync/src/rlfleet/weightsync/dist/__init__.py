"""torch.distributed transports: bounded rendezvous, member groups built by their members alone,
bucketed broadcast senders and receivers, and watched (stand-down-able) deadlines for them.
"""

from rlfleet.weightsync.dist._dist import BroadcastReceiver, BroadcastSender
from rlfleet.weightsync.dist._member import MemberGroup, member_group
from rlfleet.weightsync.dist._rendezvous import (
    Roster,
    connect_store,
    host_store,
    init_process_group_bounded,
    join_generation,
    new_group_bounded,
    reset_group_numbering,
)
from rlfleet.weightsync.dist._sync_watch import (
    WIRE_TIMEOUT_S,
    SyncWatch,
    WatchedBroadcastReceiver,
    WatchedBroadcastSender,
    WatchedDeadline,
    WatchedP2PWire,
    WatchedWire,
)

__all__ = [
    "WIRE_TIMEOUT_S",
    "BroadcastReceiver",
    "BroadcastSender",
    "MemberGroup",
    "Roster",
    "SyncWatch",
    "WatchedBroadcastReceiver",
    "WatchedBroadcastSender",
    "WatchedDeadline",
    "WatchedP2PWire",
    "WatchedWire",
    "connect_store",
    "host_store",
    "init_process_group_bounded",
    "join_generation",
    "member_group",
    "new_group_bounded",
    "reset_group_numbering",
]
