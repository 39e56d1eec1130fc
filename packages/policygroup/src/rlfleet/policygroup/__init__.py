"""rlfleet.policygroup: train and eval policies on Ray, placed, connected, synced and routed."""

from rlfleet.policygroup.__about__ import __version__

__all__ = ["__version__"]
