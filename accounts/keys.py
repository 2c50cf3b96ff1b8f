"""Redis key names of this app, in one place (the code and the tests import them from here)."""

from __future__ import annotations

# API key id -> epoch seconds of its last use, until the periodic flush writes them to the database.
LAST_USED_KEY = "accounts:last-used"
