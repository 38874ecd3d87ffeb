"""Who forks from whom among the `n` samples of one request.

The first sibling (the leader) prefills the prompt; the others (followers) wait, then
fork from it once its prompt is computed (`KVCacheManager.fork`). A forked follower
leaves the group and runs on its own.

If the leader leaves before the followers forked (finished, aborted, preempted), the
first follower becomes the leader of the rest and is scheduled normally, so the prompt
is still computed once more at most (and not at all on a prefix-cache hit).
"""

from __future__ import annotations

from collections.abc import Sequence


class SiblingGroups:
    """Leader <-> waiting followers, both directions, O(1) lookups."""

    def __init__(self) -> None:
        self._leader_of: dict[str, str] = {}
        self._followers: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._leader_of)

    def add(self, leader_id: str, follower_ids: Sequence[str]) -> None:
        if not follower_ids:
            return
        self._followers.setdefault(leader_id, []).extend(follower_ids)
        for follower_id in follower_ids:
            self._leader_of[follower_id] = leader_id

    def leader_of(self, req_id: str) -> str | None:
        """The leader `req_id` waits for, or None if it is not a waiting follower."""
        return self._leader_of.get(req_id)

    def followers_of(self, req_id: str) -> list[str]:
        return list(self._followers.get(req_id, ()))

    def discard(self, req_id: str) -> None:
        """Take `req_id` out: a follower (forked or gone) or a leader (its followers fall back)."""
        leader_id = self._leader_of.pop(req_id, None)
        if leader_id is not None:
            followers = self._followers[leader_id]
            followers.remove(req_id)
            if not followers:
                del self._followers[leader_id]
        self._promote_followers_of(req_id)

    def clear(self) -> None:
        self._leader_of.clear()
        self._followers.clear()

    def _promote_followers_of(self, leader_id: str) -> None:
        followers = self._followers.pop(leader_id, [])
        for follower_id in followers:
            del self._leader_of[follower_id]
        if followers:
            self.add(followers[0], followers[1:])
