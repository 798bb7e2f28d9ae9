"""Rank registrations and the http_sd view of them.

Agents register on start and deregister on close. A rank that dies without deregistering
(SIGKILL, segfault) is dropped the next time /sd is served: each entry's PID must still be alive
with the start time recorded at registration, so a reused PID does not keep a dead rank listed.
"""

from __future__ import annotations

from typing import Any

from .processes import process_start_time, same_process
from .store import Store


class RankRegistry:
    def __init__(self, store: Store) -> None:
        self.store = store

    def register(self, info: dict[str, Any]) -> dict[str, Any]:
        """Record ``info`` (validated by the API). Raises ValueError if the PID is not alive."""
        started = process_start_time(int(info["pid"]))
        if started is None:
            raise ValueError(f"pid {info['pid']} is not a running process on this node")
        doc = {**info, "pid_create_time": started}
        self.store.put_rank(str(info["run"]), int(info["rank"]), doc)
        return doc

    def deregister(self, run: str, rank: int) -> bool:
        return self.store.delete_rank(run, rank)

    def live(self) -> list[dict[str, Any]]:
        """Registrations whose process is alive; dead ones are removed on the way."""
        alive = []
        for doc in self.store.iter_ranks():
            if same_process(doc.get("pid"), doc.get("pid_create_time")):
                alive.append(doc)
            else:
                self.store.delete_rank(str(doc["run"]), int(doc["rank"]))
        return alive

    def http_sd(self) -> list[dict[str, Any]]:
        """Prometheus ``http_sd_configs`` groups: one target per live rank.

        The job id goes into ``job_id`` (``job`` is Prometheus's scrape-job label).
        """
        groups = []
        for doc in self.live():
            labels = {
                "run": str(doc["run"]),
                "rank": str(doc["rank"]),
                "local_rank": str(doc.get("local_rank", "")),
                "node": str(doc.get("node", "")),
            }
            if doc.get("job_id"):
                labels["job_id"] = str(doc["job_id"])
            groups.append({"targets": [f"{doc['host']}:{doc['port']}"], "labels": labels})
        return groups
