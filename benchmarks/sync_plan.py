"""The plan that runs is the plan that is drawn: SyncPlans executed on a local Ray cluster,
measured step by step and compared with what the calibrated cost model predicted.

Run: hatch run python benchmarks/sync_plan.py [--quick] [--json PATH]

Cluster: 4 raylets on this machine (node0..node3). Workers: trainer t0 on node0, t1 on node1,
rollout workers on node2 and node3 (and, for the seed comparison, one beside t0 on node0). The
cost model is calibrated once (`PolicyGroup.calibrate`: probes of the control round trip, host
copies, per-tensor and per-bucket costs and the broadcast rate, then one fit over real syncs of
three calibration groups: one sender to 4 and to 2 workers, and two senders) and predicts every
shape below; nothing is tuned
per shape.

Shapes (each a `PolicyGroup` executing placement's `plan_sync`, timed by its `SyncReport`):
  double_1t_direct   Double, one trainer broadcasts to the 4 rollout workers
  double_2t_direct   Double, two trainers each broadcast half of the buckets to all 4
  shared_1t_relay    Shared, one trainer broadcasts to one rollout worker per node, which fills
                     its node buffer for the other (node_buffer fan-out)
  shared_2t_relay    Shared, two trainers, halves, node_buffer fan-out
Scaling: Double, one trainer, 2 -> 4 -> 8 rollout workers on node1..node3.
Seed: the mixed placement (t0 and two rollout workers on node0, t1 on node1, two rollout
workers each on node2 and node3), Double: placement's `seed_sync_plan` (the seed's round robin:
t0 broadcasts to its node's rollout workers, t1 sends the whole model to node2, then to node3)
against `plan_sync` (t0 writes its node buffer once; t0 and t1 each send half to node2 and node3).

Claims:
  executed_matches_plan        1 when every measured SyncReport ran exactly its plan's steps (target 1)
  worst_prediction_ratio       max over shapes of max(predicted/measured, measured/predicted) (<= 1.5)
  plan_rank_agreement          fraction of shape pairs the model orders as measured (report)
  executed_vs_seed_plan        measured seed plan / ours, same cluster and workers (>= 1.0)
  sync_growth_8_over_2_workers measured sync time with 8 rollout workers over 2 (report)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import _claims
from _ray_cluster import local_cluster

MiB = 1 << 20
NODES = 4


def log(msg: str) -> None:
    print(f"[sync_plan {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_policy(mib: int, tensors: int) -> type:
    import torch
    from torch import nn

    from rlfleet.policygroup import BasePolicy

    class PlanPolicy(BasePolicy):
        """A model of `tensors` equal tensors, `mib` MiB in all (no compute: syncs only)."""

        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            width = mib * MiB // 4 // tensors
            return nn.ParameterList([nn.Parameter(torch.randn(width)) for _ in range(tensors)])

        def rollout_step(self, env_ret: Any) -> Any:
            return env_ret

        def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)  # every sync carries new bytes
            return {}

    return PlanPolicy


class Bench:
    def __init__(self, quick: bool) -> None:
        import ray

        self.ray = ray
        self.quick = quick
        self.mib = 32 if quick else 64  # below 32 MiB the control round trips blur the plans apart
        self.reps = 5
        self.actors: dict[str, Any] = {}
        self.cost: Any = None
        self.policy = make_policy(self.mib, 32)

    def config(self, strategy: str, senders: str = "all", planner: str = "rlfleet") -> Any:
        from rlfleet.policygroup import PolicyConfig, WeightBufferConfig

        kind = {"Double": "WeightBuffer", "Shared": "CPUWeightBuffer"}[strategy]
        wb = WeightBufferConfig(
            type=kind, buffer_strategy=strategy, bucket_bytes=4 * MiB, senders=senders, planner=planner
        )
        return PolicyConfig(
            weight_buffer=wb,
            sync_timeout_s=300.0,
            rpc_timeout_s=300.0,
            group_timeout_s=120.0,
            cost_model=self.cost,
        )

    def start(self) -> None:
        """One actor per (name, node): trainers t0, t1; rollout workers r0..r8."""
        remote = self.ray.remote(self.policy)
        places = {"t0": 0, "t1": 1, "rm": 0, "rm2": 0}
        places.update({f"r{i}": 1 + i % 3 for i in range(8)})
        cfg = self.config("Double")
        for name, node in places.items():
            role = "train" if name.startswith("t") else "eval"
            self.actors[name] = remote.options(
                num_cpus=0, max_concurrency=16, resources={f"node{node}": 1}
            ).remote(config=cfg, role=role, index=0)
        self.ray.get([a.is_alive.remote() for a in self.actors.values()], timeout=600)

    def group(self, cfg: Any, trainers: Sequence[str], rollouts: Sequence[str]) -> Any:
        from rlfleet.policygroup import PolicyGroup, TrainConfig

        group = PolicyGroup([self.actors[t] for t in trainers], [self.actors[r] for r in rollouts], cfg)
        group.init(TrainConfig())
        state = self.ray.get(self.actors[trainers[0]].get_state_dict.remote(), timeout=600)
        self.ray.get([self.actors[t].load_state_dict.remote(state) for t in trainers[1:]], timeout=600)
        group.init_placement_info()
        group.init_weight_buffer()
        group.init_comm_group("gloo")
        group.sync_weights()  # warm: buffers mapped, groups used once
        return group

    def measure(self, group: Any) -> tuple[float, float, bool, Any, dict[str, float]]:
        """(median measured s, predicted s, every report matched its plan, the plan, and the
        whole sync: the caller's median time, the report's wall time and its prediction)."""
        plan = group.sync_plan
        times, matched, reports, callers = [], True, [], []
        for _ in range(self.reps):
            group.train(None)
            began = time.perf_counter()
            report = group.sync_weights()
            callers.append(time.perf_counter() - began)
            matched &= bool(report is not None and report.ok and report.matches(plan))
            times.append(report.measured_seconds)
            reports.append(report)
        whole = {
            "caller": statistics.median(callers),
            "wall": statistics.median(r.wall_seconds for r in reports),
            "wall_predicted": statistics.median(r.predicted_wall_seconds for r in reports),
        }
        assert group.verify_eval_weight_checksums()
        median = sorted(reports, key=lambda r: r.measured_seconds)[len(reports) // 2]
        for s in median.steps:  # where the time went, step by step, in the median sync
            step = plan.steps[s.index]
            phases = " ".join(f"{k} {v * 1e3:.1f}" for k, v in s.phases.items())
            log(
                f"  {step.transport} {step.src}->{len(step.dst)}: measured {s.measured_seconds * 1e3:.1f} ms "
                f"({phases}), predicted {s.predicted_seconds * 1e3:.1f} ms"
            )
        return statistics.median(times), plan.predicted_seconds, matched, plan, whole

    def run_shape(
        self, name: str, cfg: Any, trainers: Sequence[str], rollouts: Sequence[str]
    ) -> dict[str, Any]:
        group = self.group(cfg, trainers, rollouts)
        try:
            measured, predicted, matched, plan, whole = self.measure(group)
        finally:
            group.shutdown()
        steps = ", ".join(f"{s.transport}:{s.src}->{len(s.dst)}" for s in plan.steps)
        log(f"{name}: measured {measured:.4f} s, predicted {predicted:.4f} s ({steps})")
        log(
            f"  whole sync: caller {whole['caller']:.4f} s, report {whole['wall']:.4f} s, "
            f"predicted {whole['wall_predicted']:.4f} s"
        )
        return {"name": name, "measured": measured, "predicted": predicted, "matched": matched, **whole}

    def calibrate(self) -> None:
        """One calibration for every shape: probes, then one fit over the syncs of three groups of
        their own on this cluster: one sender to 4 workers and to 2 (two fan-outs separate a
        per-receiver cost from a per-sync one), and two senders (Double; node buffers beside
        trainers, broadcasts to the other nodes)."""
        pairs = []
        # two fan-outs of one sender: the fit tells a per-receiver cost from a per-sync one
        for rollouts in (["rm", "r0", "r1", "r2"], ["r0", "r3"]):
            one = self.group(self.config("Double"), ["t0"], rollouts)
            try:
                for _ in range(self.reps):
                    one.train(None)
                    report = one.sync_weights()
                    pairs.append((report, one.sync_plan))
            finally:
                one.shutdown()
        two = self.group(self.config("Double"), ["t0", "t1"], ["rm", "r0", "r1", "r2"])
        try:
            self.cost = two.calibrate(syncs=self.reps, extra=pairs)
        finally:
            two.shutdown()
        log(f"calibrated: {self.cost.source}")


def ratio(a: float, b: float) -> float:
    return max(a / b, b / a) if a > 0 and b > 0 else float("inf")


def rank_agreement(rows: Sequence[dict[str, Any]]) -> float:
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :]]
    same = sum((a["measured"] < b["measured"]) == (a["predicted"] < b["predicted"]) for a, b in pairs)
    return same / len(pairs) if pairs else 1.0


def run(bench: Bench) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rollouts = ["r1", "r2", "r4", "r5"]  # two on node2, two on node3
    bench.calibrate()
    shapes = [
        bench.run_shape("double_1t_direct", bench.config("Double"), ["t0"], rollouts),
        bench.run_shape("double_2t_direct", bench.config("Double"), ["t0", "t1"], rollouts),
        bench.run_shape("shared_1t_relay", bench.config("Shared"), ["t0"], rollouts),
        bench.run_shape("shared_2t_relay", bench.config("Shared"), ["t0", "t1"], rollouts),
    ]
    scaling = [
        bench.run_shape(f"scaling_{n}", bench.config("Double"), ["t0"], [f"r{i}" for i in range(n)])
        for n in (2, 4, 8)
    ]
    mixed = ["rm", "rm2", *rollouts]
    ours = bench.run_shape("mixed_rlfleet", bench.config("Double"), ["t0", "t1"], mixed)
    seed = bench.run_shape("mixed_seed", bench.config("Double", planner="seed"), ["t0", "t1"], mixed)
    rows = [*shapes, *scaling, ours, seed]
    claim = _claims.claim
    claims = {
        "executed_matches_plan": claim(int(all(r["matched"] for r in rows)), 1, "bool"),
        "worst_prediction_ratio": claim(
            max(ratio(r["predicted"], r["measured"]) for r in rows), 1.5, "x", higher_is_better=False
        ),
        "plan_rank_agreement": claim(rank_agreement(shapes), None, "fraction of pairs"),
        # the report covers the whole sync as its caller waits for it, and so does the prediction
        "wall_over_caller_time": claim(min(r["wall"] / r["caller"] for r in rows), 0.9, "x"),
        "worst_wall_prediction_ratio": claim(
            max(ratio(r["wall_predicted"], r["wall"]) for r in rows), 2.0, "x", higher_is_better=False
        ),
        "executed_vs_seed_plan": claim(seed["measured"] / ours["measured"], 1.0, "x"),
        "sync_growth_8_over_2_workers": claim(scaling[2]["measured"] / scaling[0]["measured"], None, "x"),
        "predicted_growth_8_over_2_workers": claim(
            scaling[2]["predicted"] / scaling[0]["predicted"], None, "x"
        ),
    }
    return claims, rows


def main(argv: list[str] | None = None) -> int:
    args = _claims.arguments(__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with local_cluster(NODES):
        bench = Bench(args.quick)
        bench.start()
        claims, rows = run(bench)
    width = max(len(r["name"]) for r in rows)
    print(f"\n{'shape':<{width}}  {'measured':>10}  {'predicted':>10}  {'pred/meas':>9}  matches plan")
    for r in rows:
        print(
            f"{r['name']:<{width}}  {r['measured']:>9.4f}s  {r['predicted']:>9.4f}s  "
            f"{r['predicted'] / r['measured']:>8.2f}x  {r['matched']}"
        )
    return _claims.report(
        claims, args.json, title=f"sync_plan claims (calibrated: {bench.cost.source[:160]})"
    )


if __name__ == "__main__":
    sys.exit(main())
