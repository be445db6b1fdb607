"""SubprocessEnvManager in a minute: first-ready stepping of uneven envs, and a fault.

Four envs whose steps take 1, 2, 4 and 8 ms: the fast ones are stepped again while the slow
ones are still busy, so each env advances at its own pace. Then an env raises, and the error
arrives with the worker's traceback.

    python examples/quickstart.py
"""

from __future__ import annotations

import collections

from envmanager import SubprocessEnvManager, WorkerError
from envmanager.testing.envs import EnvFactory


def main() -> None:
    factory = EnvFactory(per_env={w: {"step_time": 0.001 * 2**w} for w in range(4)}, episode_length=50)
    steps = collections.Counter()
    with SubprocessEnvManager(factory, n_env=4, timeout=10) as manager:
        manager.set_policy(lambda info: 1)  # a policy maps a worker's last StepInfo to its action
        manager.reset(seed=0)
        for _ in range(200):
            for info in manager.step():  # whoever finished, as soon as one did
                steps[info.worker_id] += 1
        print("steps per worker after 200 calls:", dict(sorted(steps.items())))
        assert steps[0] > steps[3], "the fast env should have run ahead of the slow one"

        manager.set_attr("fault", "raise", worker_ids=[2])
        manager.set_attr("fault_at", 0, worker_ids=[2])
        try:
            for _ in range(10):
                manager.step()
        except WorkerError as err:
            print(f"caught: worker {err.worker_id} raised {err.exc_type}; its traceback ends with:")
            print("   ", err.remote_traceback.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
