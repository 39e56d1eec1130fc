"""rlfleet.policygroup: PolicyGroup on Ray: train and eval policies placed, connected, synced and routed, composed from rlfleet routing, placement and weightsync."""

from rlfleet.policygroup.__about__ import __version__

__all__ = ["__version__"]
