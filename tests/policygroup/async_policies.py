"""Policies for the async-RL tests (pickled by value into Ray workers): each records the versions
it went live with (`on_weight_version`), and can be made slow or faulty on request."""

from __future__ import annotations

import time
from typing import Any

from pg_policies import MLPPolicy


class AsyncPolicy(MLPPolicy):
    """`MLPPolicy` that records every version it served (its new-version hook), with knobs:
    `apply_delay` (a slow swap: a lagging rollout worker), `publish_delay` (a slow snapshot of a
    node-buffer writer), `fail_publish` (its next publish raises)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.live_versions: list[int] = []
        self.apply_delay = 0.0
        self.publish_delay = 0.0
        self.fail_publish = False
        super().__init__(*args, **kwargs)

    def on_weight_version(self, version: int) -> None:
        self.live_versions.append(version)

    def get_live_versions(self) -> list[int]:
        return list(self.live_versions)

    def configure(self, **knobs: Any) -> None:
        for name, value in knobs.items():
            if not hasattr(self, name):
                raise AttributeError(name)
            setattr(self, name, value)

    def apply_staged(self, *args: Any, **kwargs: Any) -> int:
        time.sleep(self.apply_delay)
        return super().apply_staged(*args, **kwargs)

    def publish_shared(self, version: int, timeout_s: float) -> int:
        if self.fail_publish:
            raise RuntimeError(f"injected: the node buffer write of v{version} failed")
        time.sleep(self.publish_delay)
        return super().publish_shared(version, timeout_s)
