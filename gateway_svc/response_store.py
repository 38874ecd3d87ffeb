"""Stored responses of `/v1/responses` (`store: true`, OpenAI's default): SQLite in one file, so
that `previous_response_id` and `GET /v1/responses/{id}` work across gateway restarts.

Each row is one response of one tenant: the SHA-256 of the caller's API key (no key: of the empty
string), never the key itself. Every read and delete is keyed by (tenant, id), so another tenant's
id is as unknown as one never made (404). A row holds the response object as returned, and the
conversation it ends as chat messages (`history`: the earlier turns, this turn's input, and its
output as an assistant turn), which is what a later `previous_response_id` continues.

Retention: at most `max_count` rows (the oldest go first) and none older than `max_age_s`,
enforced on every write. The statements are a few short ones on an indexed table, run on the
event loop's thread (well under a millisecond each, WAL journal).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_COUNT = 10_000
DEFAULT_MAX_AGE_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days


def default_path() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(data) / "pagoda" / "responses.sqlite3"


def tenant_of(api_key: str | None) -> str:
    return hashlib.sha256((api_key or "").encode()).hexdigest()


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    history: list[dict]


class ResponseStore:
    """The table described in the module docstring."""

    def __init__(self, path: Path | str, max_count: int = DEFAULT_MAX_COUNT, max_age_s: float = DEFAULT_MAX_AGE_S):
        if max_count < 1 or not max_age_s > 0:
            raise ValueError(f"retention: max_count >= 1 and max_age_s > 0, got {max_count} and {max_age_s}")
        self.path, self.max_count, self.max_age_s = Path(path), max_count, max_age_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS responses (tenant TEXT NOT NULL, id TEXT NOT NULL, "
                         "created REAL NOT NULL, response TEXT NOT NULL, history TEXT NOT NULL, "
                         "PRIMARY KEY (tenant, id))")
        self._db.execute("CREATE INDEX IF NOT EXISTS responses_created ON responses (created)")

    def put(self, tenant: str, response: dict, history: list[dict]) -> None:
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                             (tenant, response["id"], now, json.dumps(response), json.dumps(history)))
            self._db.execute("DELETE FROM responses WHERE created < ?", (now - self.max_age_s,))
            self._db.execute("DELETE FROM responses WHERE rowid NOT IN (SELECT rowid FROM responses "
                             "ORDER BY created DESC, rowid DESC LIMIT ?)", (self.max_count,))

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        row = self._db.execute("SELECT response, history FROM responses WHERE tenant = ? AND id = ? AND created >= ?",
                               (tenant, response_id, time.time() - self.max_age_s)).fetchone()
        return StoredResponse(json.loads(row[0]), json.loads(row[1])) if row else None

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id)).rowcount > 0

    def __len__(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        self._db.close()
