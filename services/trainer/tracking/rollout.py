"""The rollout side's throughput as the trainer can see it: the buffer's counters (BufferStats),
read once a step. Groups produced are those the buffer accepted plus those the workers dropped
for equal rewards (generated all the same); their rate between two steps is the rollout
workers' output, whatever engine, replicas or episodes made it."""

from __future__ import annotations


class RolloutRate:
    def __init__(self, group_size: int):
        self.group_size = group_size
        self._last: tuple[int, float] | None = None  # (groups produced, time)

    def observe(self, stats, now: float) -> dict[str, float]:
        """`stats`: a BufferStats; `now`: a monotonic time in seconds."""
        produced = stats.accepted_total + stats.skipped_uniform_total
        values = {"rollout/accepted_groups_total": float(stats.accepted_total),
                  "rollout/skipped_groups_total": float(stats.skipped_uniform_total),
                  "rollout/buffer_depth_groups": float(stats.depth_groups),
                  "rollout/running_slots": float(stats.running_slots)}
        if self._last is not None and now > self._last[1]:
            per_second = (produced - self._last[0]) / (now - self._last[1])
            values["rollout/groups_per_second"] = per_second
            values["rollout/samples_per_second"] = per_second * self.group_size
        self._last = (produced, now)
        return values
