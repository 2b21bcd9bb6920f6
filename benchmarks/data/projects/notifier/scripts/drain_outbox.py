"""Dry-run one outbox batch and print the delivery log."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from notifier.dispatch import PermanentFailure, deliver  # noqa: E402

REFUSED = {"ops-lead@platform.example": "550 5.1.1 mailbox unavailable"}
SLOW = {"msg-20d41c"}


def main(path: str) -> None:
    attempts = {}
    counts = {"sent": 0, "failed": 0, "crashed": 0}
    for line in Path(path).read_text().splitlines():
        message = json.loads(line)

        def send(to, body, message=message):
            attempts[message["id"]] = attempts.get(message["id"], 0) + 1
            if to in REFUSED:
                raise PermanentFailure(REFUSED[to])
            if message["id"] in SLOW and attempts[message["id"]] < 3:
                raise TimeoutError

        try:
            counts[deliver(message, send, lambda text: print("  " + text))] += 1
        except Exception as err:  # noqa: BLE001 - the dry run reports every crash and goes on
            counts["crashed"] += 1
            print(f"  {message['id']} CRASHED: {type(err).__name__}: {err}")
    print(f"batch done: {counts['sent']} sent, {counts['failed']} failed, {counts['crashed']} crashed")


if __name__ == "__main__":
    main(sys.argv[1])
