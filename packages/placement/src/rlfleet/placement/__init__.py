"""rlfleet.placement: Topology graphs, placement plans, communication-group plans and topology-aware weight-transfer planning for RL post-training clusters."""

from rlfleet.placement.__about__ import __version__

__all__ = ["__version__"]
