"""``envmanager-learn`` with a recorder on ML-Agents' ``AgentProcessor`` (for the tests only).

``python trainer_hook.py <envmanager-learn arguments>`` with ``ENVMANAGER_TRAINER_RECORD=<path>``
runs ``envmanager.mlagents.learn.main`` and, at exit, writes to ``<path>`` what the trainer made
of the players' steps:

* ``results``: per worker id, the steps handed to ``AgentProcessor.add_experiences`` (resets
  included: ML-Agents' own count of what the env manager delivered);
* ``experiences``: per ``"<worker>-<agent>"``, the experiences (one per action an agent took)
  ``AgentProcessor`` built;
* ``checked`` / ``mismatches``: each experience's recorded action against the action its player
  echoed in the next observation (the fake player's ``echo_actions``: observation 1 holds the
  agent's last discrete action received).

Only the standard library is imported at module level: the ``forkserver`` that starts the
workers imports this file as its ``__main__``.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
from collections import Counter
from typing import Any


def install(path: str) -> None:
    from mlagents.trainers import agent_processor as ap

    record: dict[str, Any] = {"results": Counter(), "experiences": Counter(), "checked": 0, "mismatches": []}
    current: dict[str, Any] = {}
    make_experience = ap.AgentExperience
    process_step = ap.AgentProcessor._process_step
    add_experiences = ap.AgentProcessor.add_experiences

    def experience(**fields: Any) -> Any:
        gid, received = current["gid"], current["received"]
        recorded = int(fields["action"].discrete[0])
        record["experiences"][gid] += 1
        record["checked"] += 1
        if recorded != received and len(record["mismatches"]) < 20:
            record["mismatches"].append({"agent": gid, "recorded": recorded, "received": received})
        return make_experience(**fields)

    def recording_process_step(self: Any, step: Any, worker_id: int, index: int) -> None:
        current.update(gid=f"{worker_id}-{int(step.agent_id)}", received=round(float(step.obs[1][0])))
        try:
            process_step(self, step, worker_id, index)
        finally:
            current.clear()

    def recording_add_experiences(self: Any, decision_steps: Any, terminal_steps: Any, worker_id: int,
                                  previous_action: Any) -> None:
        record["results"][str(worker_id)] += 1
        add_experiences(self, decision_steps, terminal_steps, worker_id, previous_action)

    def write() -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**record, "results": dict(record["results"]), "experiences": dict(record["experiences"])}, f)

    ap.AgentExperience = experience
    ap.AgentProcessor._process_step = recording_process_step
    ap.AgentProcessor.add_experiences = recording_add_experiences
    atexit.register(write)


def main() -> int:
    install(os.environ["ENVMANAGER_TRAINER_RECORD"])
    from envmanager.mlagents.learn import main as learn

    return learn(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
