"""Ctrl-C that the program catches, landing anywhere in the manager's sends and receives:
nothing half-sent, no answer lost, and the manager goes on (``envmanager.wire.interrupts``).

Each case runs a program of its own (its SIGINT handler and Ctrl-Cs stay there): a thread sends
it SIGINTs every fraction of a millisecond while its main thread steps envs that count their
steps, catching every ``KeyboardInterrupt`` and carrying on. With the batch API every step an env
took must reach the program exactly once; the drop-ins must go on in step with their envs, an
interrupted step left pending as gymnasium's and SB3's leave it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent(
    """
    import faulthandler, json, os, random, signal, sys, threading, time
    faulthandler.dump_traceback_later(100)  # a program still running then shows where it is (stderr)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})  # as started from a terminal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    import numpy as np
    from envmanager import SubprocessEnvManager
    from envmanager.core.slots import IN_FLIGHT
    from envmanager.testing.envs import EnvFactory
    from envmanager.wire.interrupts import DEFERRED

    n = {n_env}
    m = SubprocessEnvManager(EnvFactory(), n, envs_per_worker={per_worker}, timeout=30)
    m.reset()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a notebook puts it back for each cell
    counted = [0] * n  # each slot's steps received, read off its observation (the env counts them)
    problems, interrupts = [], 0

    def count_received():
        # Idempotent (a Ctrl-C in here only repeats it): an idle slot's observation is its last result.
        observation = m.results.observation
        for s in m.idle_worker_ids:
            c = int(observation[s, 0])
            if c == counted[s] + 1:
                counted[s] = c
            elif c != counted[s]:
                problems.append(f"slot {{s}}: step {{c}} received after step {{counted[s]}}")

    stop = threading.Event()
    rng = random.Random({seed})

    def press_ctrl_c():
        while not stop.is_set():
            time.sleep(rng.uniform(0.0001, 0.002))
            if not stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    check = False
    while interrupts < {interrupts} and not problems:
        try:
            if check:  # after a Ctrl-C: no slot in flight that its process was not asked to step
                check = False
                bad = [s for s in range(n) if m.status[s] == IN_FLIGHT and not m.process_of(s).busy]
                if bad:
                    problems.append(f"slots {{bad}} in flight, their processes asked nothing")
            count_received()
            idle = m.idle_worker_ids
            if idle:
                m.send_batch(idle, np.ones(len(idle), dtype=np.int64))
            m.receive_batch(timeout=30)
        except KeyboardInterrupt:
            interrupts += 1
            check = True
        except Exception as exc:
            problems.append(repr(exc))
    stop.set()
    presser.join()
    for _ in range(3):  # a Ctrl-C still on its way, or held back
        try:
            time.sleep(0.05)
            with DEFERRED:
                pass
        except KeyboardInterrupt:
            pass
    if not problems:
        while m.waiting_worker_ids:
            m.receive_batch(timeout=30)
        count_received()
        taken = m.get_attr("total_steps")
        if taken != counted:
            problems.append(f"the envs took {{taken}} steps, the program received {{counted}}")
    m.close()
    print(json.dumps({{"problems": problems, "interrupts": interrupts, "received": sum(counted)}}))
    """
)


@pytest.mark.parametrize(
    ("transport", "per_worker"),
    [("step_queue", 1), ("step_queue", 2), ("board", 2), ("portable", 1)],
)
def test_caught_ctrl_c_loses_nothing(transport, per_worker):
    env = {**os.environ, "ENVMANAGER_TRANSPORT": "step_queue" if transport == "board" else transport,
           "ENVMANAGER_MAILBOX": "on" if transport == "board" else "off"}
    program = PROGRAM.format(repo=REPO, n_env=4, per_worker=per_worker, seed=per_worker, interrupts=400)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=240,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome["problems"] == [], (outcome, proc.stderr[-2000:])
    assert outcome["interrupts"] == 400
    assert outcome["received"] > 0


DROPIN = textwrap.dedent(
    """
    import faulthandler, json, os, random, signal, sys, threading, time
    faulthandler.dump_traceback_later(100)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path[:0] = [{repo!r}, {tests!r}]
    import numpy as np
    from dropin_envs import Make
    from envmanager.wire.interrupts import DEFERRED

    def main():
        fns = [Make("CountEnv", env_id=i) for i in range(4)]
        if {kind!r} == "gymnasium":
            from gymnasium.error import AlreadyPendingCallError as Pending
            from envmanager import AsyncVectorEnv
            envs = AsyncVectorEnv(fns, envs_per_worker=1)
            envs.reset(seed=0)
        else:
            from envmanager.errors import InvalidInputError as Pending
            from envmanager.sb3 import SubprocVecEnv
            envs = SubprocVecEnv(fns, envs_per_worker=1)
            envs.reset()
        stop = threading.Event()
        rng = random.Random(0)

        def press_ctrl_c():
            while not stop.is_set():
                time.sleep(rng.uniform(0.0001, 0.002))
                if not stop.is_set():
                    os.kill(os.getpid(), signal.SIGINT)

        presser = threading.Thread(target=press_ctrl_c, daemon=True)
        presser.start()
        problems, interrupts, pending = [], 0, False
        actions = np.ones(4, dtype=np.int64)
        while interrupts < {interrupts} and not problems:
            try:
                if pending:  # the step a Ctrl-C left pending
                    envs.step_wait()
                    pending = False
                else:
                    envs.step(actions)
            except KeyboardInterrupt:
                interrupts += 1
            except Pending as exc:  # the refusal that says a step is pending
                if "pending" not in str(exc):
                    problems.append(repr(exc))
                pending = True
            except Exception as exc:
                problems.append(repr(exc))
        stop.set()
        presser.join()
        for _ in range(3):  # a Ctrl-C still on its way, or held back
            try:
                time.sleep(0.05)
                with DEFERRED:
                    pass
            except KeyboardInterrupt:
                pass
        if not problems:
            try:
                envs.step(actions)
            except Pending:
                envs.step_wait()
            observations = envs.step(actions)[0]
            taken = list(envs.get_attr("total"))
            if observations[:, 3].tolist() != taken:  # the last step's results are the envs' last
                problems.append(f"the last observations say {{observations[:, 3].tolist()}} steps, the envs took {{taken}}")
        envs.close()
        print(json.dumps({{"problems": problems, "interrupts": interrupts}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("kind", ["gymnasium", "sb3"])
def test_caught_ctrl_c_leaves_the_dropins_in_step(kind, tmp_path):
    if kind == "sb3":
        pytest.importorskip("stable_baselines3")
    program = tmp_path / "program.py"  # (SB3's default start method imports the main module)
    program.write_text(DROPIN.format(repo=REPO, tests=os.path.join(REPO, "tests"), kind=kind, interrupts=1000))
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=240,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome == {"problems": [], "interrupts": 1000}, proc.stderr[-2000:]
