"""Where a policy version's weights are announced, shared by the trainer (writer, through the
buffer service) and the rollout workers (readers).

Per job, in Redis (key names: asyncrl.platform.redis_keys): the hash `weights` holds the newest
`version`, its `uri` and `updated_unix_ms`; every change is also published on the channel of
the same name.
A reader subscribes first and then reads the hash, so it can never miss the newest version;
it also re-reads the hash periodically, which covers messages lost while disconnected.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.platform.redis_keys import weights_channel, weights_key

__all__ = ["WeightVersion", "weights_channel", "weights_key"]


@dataclass(frozen=True)
class WeightVersion:
    version: int
    uri: str
    updated_unix_ms: int = 0

    @classmethod
    def from_hash(cls, values: dict) -> WeightVersion | None:
        """From the Redis hash (bytes or str values); None if nothing was announced yet."""
        if not values:
            return None
        decoded = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in values.items()
        }
        return cls(int(decoded["version"]), decoded["uri"], int(decoded.get("updated_unix_ms", 0)))

    def to_hash(self) -> dict[str, str]:
        return {"version": str(self.version), "uri": self.uri,
                "updated_unix_ms": str(self.updated_unix_ms)}
