"""Policy weights between trainer and rollout: announcements in Redis, the distributed transfer."""
