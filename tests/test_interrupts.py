"""Ctrl-C that the program catches, landing anywhere in the manager's sends and receives:
nothing half-sent, no answer lost, and the manager goes on (``envmanager.wire.interrupts``).

Each case runs a program of its own (its SIGINT handler and Ctrl-Cs stay there): a thread sends
it SIGINTs every fraction of a millisecond while its main thread steps envs that count their
steps, catching every ``KeyboardInterrupt`` and carrying on. With the batch API every step an env
took must reach the program exactly once; the drop-ins must go on in step with their envs, an
interrupted step left pending as gymnasium's and SB3's leave it; the samplers must return each
episode's steps once each, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(template: str, tmp_path, env=None, timeout=240, **values) -> tuple[dict, str]:
    """Run a program of its own (a file: SB3's default start method imports the main module); its
    outcome, the last line it printed, and the end of its stderr."""
    program = tmp_path / "program.py"
    program.write_text(template.format(repo=REPO, tests=os.path.join(REPO, "tests"), **values))
    proc = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=env, timeout=timeout,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr[-2000:]

PROGRAM = textwrap.dedent(
    """
    import json, signal, sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import Presser, as_from_a_terminal
    as_from_a_terminal()
    import numpy as np
    from envmanager import SubprocessEnvManager
    from envmanager.core.slots import IN_FLIGHT
    from envmanager.testing.envs import EnvFactory

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

    presser = Presser({seed})
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
    presser.stop()
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
def test_caught_ctrl_c_loses_nothing(transport, per_worker, tmp_path):
    env = {**os.environ, "ENVMANAGER_TRANSPORT": "step_queue" if transport == "board" else transport,
           "ENVMANAGER_MAILBOX": "on" if transport == "board" else "off"}
    outcome, stderr = run(PROGRAM, tmp_path, env, n_env=4, per_worker=per_worker, seed=per_worker, interrupts=400)
    assert outcome["problems"] == [], (outcome, stderr)
    assert outcome["interrupts"] == 400
    assert outcome["received"] > 0


DROPIN = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import Presser, as_from_a_terminal
    as_from_a_terminal()
    import numpy as np
    from dropin_envs import Make

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
        presser = Presser(0)
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
        presser.stop()
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
    outcome, stderr = run(DROPIN, tmp_path, kind=kind, interrupts=1000)
    assert outcome == {"problems": [], "interrupts": 1000}, stderr


# Ctrl-Cs from another process (a terminal's land anywhere in time; a thread of the program's own can send only
# while it holds the GIL, so its Ctrl-Cs land almost only where the main thread releases it: in waits and writes).
# They reach envmanager's handler only inside the library's calls (``Guard``): one the program would take in its
# own code is dropped, so a result lost or doubled is the library's. Each returned result is checked against the
# one before it (not read back from shared memory, which would hide a result handed to nobody).
GUARDED = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, tempfile, time
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import as_from_a_terminal
    as_from_a_terminal()
    import numpy as np
    import envmanager.wire.interrupts as interrupts

    # Half the presses while the program is descheduled (handled late, wherever it then is).
    PRESSER = "import os, random, signal, sys, time\\n" \\
        "pid, stop, rng = int(sys.argv[1]), sys.argv[2], random.Random(0)\\n" \\
        "while not os.path.exists(stop):\\n" \\
        "    time.sleep(rng.uniform(0.0001, 0.002))\\n" \\
        "    late = rng.random() < 0.5\\n" \\
        "    try:\\n" \\
        "        if late: os.kill(pid, signal.SIGSTOP)\\n" \\
        "        try:\\n" \\
        "            os.kill(pid, signal.SIGINT)\\n" \\
        "            if late: time.sleep(0.015)\\n" \\
        "        finally:\\n" \\
        "            if late: os.kill(pid, signal.SIGCONT)\\n" \\
        "    except ProcessLookupError: break\\n"

    class Guard:
        def __init__(self):
            self.inside = False
            signal.signal(signal.SIGINT, self.handler)
        def handler(self, signum, frame):
            if self.inside:
                return interrupts._on_sigint(signum, frame)
        def call(self, f, *a):  # (plain calls: CPython checks for signals after f(*a) returns, not after f(x))
            self.inside = True
            try:
                if len(a) == 0:
                    return f()
                if len(a) == 1:
                    return f(a[0])
                return f(a[0], a[1])
            finally:
                self.inside = False

    def main():
        kind, n = {kind!r}, 4
        if kind == "core":
            from envmanager import SubprocessEnvManager
            from envmanager.testing.envs import EnvFactory
            m = SubprocessEnvManager(EnvFactory(), n, envs_per_worker=2, timeout=30)
            m.reset()
            step = lambda: m.step([1] * n, 30)
            counts = lambda got: [(i.worker_id, int(i.current_result.observation[0])) for i in got]
            close = m.close
        else:
            from dropin_envs import Make
            fns = [Make("CountEnv", env_id=i) for i in range(n)]
            if kind == "gymnasium":
                from envmanager import AsyncVectorEnv
                envs = AsyncVectorEnv(fns, envs_per_worker=1)
                envs.reset(seed=0)
            else:
                from envmanager.sb3 import SubprocVecEnv
                envs = SubprocVecEnv(fns, envs_per_worker=1)
                envs.reset()
            actions = np.ones(n, dtype=np.int64)
            def step():
                try:
                    return envs.step(actions)
                except Exception as exc:
                    if "pending" not in str(exc):
                        raise
                return envs.step_wait()  # the step a Ctrl-C left pending
            counts = lambda got: list(enumerate(got[0][:, 3].astype(int).tolist()))
            close = envs.close
        guard = Guard()
        stop = tempfile.mktemp()
        presser = subprocess.Popen([sys.executable, "-c", PRESSER, str(os.getpid()), stop])
        seen, problems, caught = [0] * n, [], 0
        while caught < {interrupts} and len(problems) < 5:
            try:
                got = guard.call(step)
            except KeyboardInterrupt:
                caught += 1
                continue
            except Exception as exc:
                problems.append(repr(exc))
                continue
            for slot, count in counts(got):  # (the program's own work: outside the guard)
                if count != seen[slot] + 1:
                    problems.append(f"env {{slot}}: step {{count}} after step {{seen[slot]}}")
                seen[slot] = count
        open(stop, "w").close()
        presser.wait()
        time.sleep(0.05)
        close()
        print(json.dumps({{"problems": problems, "interrupts": caught}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("kind", ["core", "gymnasium", "sb3"])
def test_ctrl_c_anywhere_in_a_call_loses_no_result(kind, tmp_path):
    if kind == "sb3":
        pytest.importorskip("stable_baselines3")
    outcome, stderr = run(GUARDED, tmp_path, kind=kind, interrupts=200)
    assert outcome == {"problems": [], "interrupts": 200}, stderr


HELD = textwrap.dedent(
    """
    import json, signal, sys, time
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import as_from_a_terminal
    as_from_a_terminal()
    from envmanager import SubprocessEnvManager
    from envmanager.core.slots import SlotState
    from envmanager.testing.envs import EnvFactory

    m = SubprocessEnvManager(EnvFactory(), 2)
    m.reset()
    if {notebook!r}:  # ipykernel: its handler (SIG_IGN) back after the cell that made the manager, Python's before the next
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    hand_out = SlotState.hand_out
    pressed = []

    def pressing(self, *args, **kwargs):  # Ctrl-C while the answers are handed out (held back there)
        if not pressed:
            pressed.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)
        return hand_out(self, *args, **kwargs)

    SlotState.hand_out = pressing
    outcome = {{}}
    try:
        outcome["results"] = len(m.step([1, 1])) > 0  # (as soon as one finished)
    except KeyboardInterrupt:
        outcome["results"] = "lost: raised in the call"
    SlotState.hand_out = hand_out
    try:
        while time.monotonic() - pressed[0] < 30.0:  # a learner's update, no call to the manager
            sum(range(1000))
        outcome["raised"] = "never (or at the next call)"
    except KeyboardInterrupt:
        outcome["raised"] = "during the update"
    m.close()
    print(json.dumps(outcome))
    """
)


@pytest.mark.parametrize("notebook", [False, True])
def test_a_ctrl_c_held_back_comes_once_the_call_returned(notebook, tmp_path):
    """Not at the manager's next call (after the learner's update, or never if the program ends there); in a
    notebook's later cells too."""
    outcome, stderr = run(HELD, tmp_path, timeout=120, notebook=notebook)
    assert outcome == {"results": True, "raised": "during the update"}, stderr


IN_A_FINALIZER = textwrap.dedent(
    """
    import json, signal, sys, time
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import as_from_a_terminal
    as_from_a_terminal()
    from envmanager import SubprocessEnvManager
    from envmanager.testing.envs import EnvFactory

    m = SubprocessEnvManager(EnvFactory(), 1)
    m.reset()  # (its sections took Ctrl-C over)
    time.sleep(1.5)  # long after the call: no grace holds what comes now

    class Dropped:
        def __del__(self):  # Python handles a Ctrl-C pressed meanwhile here, in the finalizer
            signal.raise_signal(signal.SIGINT)

    outcome = {{}}
    try:
        Dropped()
        start = time.monotonic()
        while time.monotonic() - start < 5.0:
            sum(range(1000))
        outcome["raised"] = "never (printed and dropped in the finalizer)"
    except KeyboardInterrupt:
        outcome["raised"] = "after the finalizer"
    m.close()
    print(json.dumps(outcome))
    """
)


def test_a_ctrl_c_handled_in_a_finalizer_is_raised_after_it(tmp_path):
    """A program's Ctrl-C that Python handled while a finalizer ran (a pipe's ``__del__``, say) was raised there,
    where Python prints it and goes on: ``envmanager check`` under load ran to its time limit."""
    outcome, stderr = run(IN_A_FINALIZER, tmp_path, timeout=120)
    assert outcome == {"raised": "after the finalizer"}, stderr


BETWEEN_CELLS = textwrap.dedent(
    """
    import json, signal, sys, time
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import as_from_a_terminal
    as_from_a_terminal()
    from envmanager import SubprocessEnvManager
    from envmanager.core.slots import SlotState
    from envmanager.testing.envs import EnvFactory
    from envmanager.wire import interrupts

    m = SubprocessEnvManager(EnvFactory(), 2)
    m.reset()
    hand_out = SlotState.hand_out

    def pressing(self, *args, **kwargs):  # Ctrl-C while the answers are handed out, at the end of the cell
        SlotState.hand_out = hand_out
        signal.raise_signal(signal.SIGINT)
        return hand_out(self, *args, **kwargs)

    SlotState.hand_out = pressing
    m.step([1, 1])
    signal.signal(signal.SIGINT, {between!s})  # the cell ends: the program's handler (ipykernel's: ignored)
    until = time.monotonic() + 30
    while interrupts._redelivery_due and time.monotonic() < until:  # the press comes between cells
        time.sleep(0.01)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the next cell
    outcome = {{}}
    try:
        m.step([1, 1])
        outcome["next call"] = "fine"
    except KeyboardInterrupt:
        outcome["next call"] = "KeyboardInterrupt (the press of the cell before)"
    signal.raise_signal(signal.SIGINT)  # a press in the program's own code
    try:
        time.sleep(1.0)
        outcome["later press"] = "swallowed"
    except KeyboardInterrupt:
        outcome["later press"] = "raised"
    m.close()
    print(json.dumps(outcome))
    """
)


@pytest.mark.parametrize("between", ["signal.SIG_IGN", "lambda signum, frame: None"])
def test_a_ctrl_c_held_back_goes_to_the_handler_in_place_when_it_comes(between, tmp_path):
    """A notebook's cell ending (or the program's own handler put in place) while a Ctrl-C is
    held: the press is theirs. It came back at the next cell's first call, and swallowed the
    cell's next real Ctrl-C."""
    outcome, stderr = run(BETWEEN_CELLS, tmp_path, timeout=120, between=between)
    assert outcome == {"next call": "fine", "later press": "raised"}, stderr


RAY_SAMPLER = textwrap.dedent(
    """
    import json, os, sys, tempfile
    sys.path[:0] = [{repo!r}, {tests!r}]
    os.environ["RAY_USAGE_STATS_ENABLED"], os.environ["RAY_AUTH_MODE"] = "0", "disabled"
    from interrupt_helpers import Presser, as_from_a_terminal
    import ray
    from ray_helpers import NODE_START_S, pickle_by_value
    from sampler_envs import RandomPolicy, kind_env
    from envmanager.ray import RaySampler

    def main():
        pickle_by_value()
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rayt"), log_to_driver=False)
        as_from_a_terminal()
        sampler = RaySampler(kind_env, RandomPolicy(), nodes=2, envs_per_node=2, fragment_steps=16, seed=1, timeout=30.0,
                             start_timeout=NODE_START_S)
        presser = Presser(3)
        seen, problems, caught = {{}}, [], 0
        while caught < {interrupts} and len(problems) < 5:
            try:
                batch = sampler.obtain_steps(20)
            except KeyboardInterrupt:
                caught += 1
                continue
            except Exception as exc:
                problems.append(repr(exc))
                continue
            rows = zip(batch.worker_ids.tolist(), batch.episode_ids.tolist(), batch.observations[:, 0].tolist(),
                       batch.next_observations[:, 0].tolist())
            for w, e, t, t_next in rows:  # each episode's steps once each, in order, from its first
                steps = seen.setdefault((w, e), [])
                if t != len(steps) or t_next != t + 1:
                    problems.append(f"worker {{w}} episode {{e}}: step {{t}} -> {{t_next}} after {{len(steps)}} steps")
                steps.append(t)
        presser.stop()
        sampler.close()
        ray.shutdown()
        print(json.dumps({{"problems": problems, "interrupts": caught, "steps": sum(map(len, seen.values()))}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(360)  # the nodes' start may take minutes on a loaded machine (``NODE_START_S``)
def test_caught_ctrl_c_loses_no_step_of_the_ray_sampler(tmp_path):
    """As the local samplers' (transitions across calls): the fragments a call had taken from the
    nodes were lost with it (the next call's episodes went on from their middle, within 25 presses)."""
    pytest.importorskip("ray")
    outcome, stderr = run(RAY_SAMPLER, tmp_path, timeout=330, interrupts=100)
    assert outcome["problems"] == [] and outcome["interrupts"] == 100, (outcome, stderr)
    assert outcome["steps"] > 0



# PettingZoo's layers, on envs whose agents say where they are (``pettingzoo_envs.ScheduleParallelEnv``, read by
# ``interrupt_helpers.EnvRows``): each result handed out is checked against the one before it. Each layer's work
# after the core's last section (its batch handed out) is made slower than the grace that holds a Ctrl-C there
# (``interrupt_helpers.slowed``, on every third call), as a large batch's is: its own sections must hold it.
VECTOR = textwrap.dedent(
    """
    import json, sys, tempfile
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import EnvRows, Presser, as_from_a_terminal, slowed
    as_from_a_terminal()
    from envmanager.errors import InvalidInputError
    from envmanager.pettingzoo import ParallelVectorEnv, vector
    from pettingzoo_envs import ScheduleParallelFn

    slowed(vector, "gather")  # the batch handed out

    def main():
        n, agents, lockstep = 4, EnvRows.AGENTS, {lockstep!r}
        v = ParallelVectorEnv([ScheduleParallelFn(i, tempfile.mkdtemp()) for i in range(n)], envs_per_worker={per_worker},
                              timeout=30)
        problems, interrupts = [], 0
        envs = EnvRows(v.reset(seed=0).observation.reshape(n, agents, -1), problems)
        busy = set()  # envs sent a step whose result was not taken (as far as the program knows)

        def take(batch):
            k = len(batch.env_ids)
            obs, present = batch.observation.reshape(k, agents, -1), batch.present.reshape(k, agents)
            active, terminated = batch.active.reshape(k, agents), batch.terminated.reshape(k, agents)
            for row, i in enumerate(batch.env_ids.tolist()):
                if batch.restarted[row] or batch.episode_end[row] == active[row].any():
                    problems.append(f"env {{i}}: restarted {{batch.restarted[row]}}, episode_end "
                                    f"{{batch.episode_end[row]}}, active {{active[row].tolist()}}")
                envs.take(i, obs[row], present[row], terminated[row], bool(batch.episode_start[row]))
                busy.discard(i)

        def pending(exc):  # the refusal that says a step was sent whose result recv() has not returned
            if "recv() has not returned" not in str(exc):
                raise exc

        presser = Presser({seed})
        got = None
        while interrupts < {interrupts} and not problems:
            try:
                if got is not None:  # (again, if a Ctrl-C cut it short)
                    take(got)
                    got = None
                idle = [i for i in range(n) if i not in busy]
                if lockstep and busy:  # the step a Ctrl-C cut short
                    got = v.recv(n, sort=True)
                elif lockstep:
                    got = v.step(envs.actions(idle))
                else:  # EnvPool's: the idle envs sent a step, the first to finish received
                    try:
                        v.send(envs.actions(idle), env_ids=idle)
                        busy.update(idle)
                    except InvalidInputError as exc:  # some still stepping (a Ctrl-C came after their send returned)
                        pending(exc)
                    got = v.recv(1)
            except KeyboardInterrupt:
                interrupts += 1
            except InvalidInputError as exc:
                try:
                    pending(exc)
                    busy.update(range(n))
                except InvalidInputError:
                    problems.append(repr(exc))
            except Exception as exc:
                problems.append(repr(exc))
        presser.stop()
        try:
            if not problems:
                if got is not None:
                    take(got)
                while busy:
                    take(v.recv(1))
                while True:  # a step of every env, once those stepping that the program did not know of are in
                    try:
                        take(v.step(envs.actions(list(range(n)))))
                        break
                    except InvalidInputError as exc:
                        pending(exc)
                        take(v.recv(1))
                envs.in_step_with(v.call("episode"), v.call("t"))
        except Exception as exc:
            problems.append(repr(exc))
        v.close()
        print(json.dumps({{"problems": problems[:5], "interrupts": interrupts, "taken": envs.taken}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize(("lockstep", "per_worker"), [(True, 1), (False, 2)])
def test_caught_ctrl_c_leaves_parallel_vector_env_in_step(lockstep, per_worker, tmp_path):
    """Lockstep ``step()`` (a step cut short is refused as pending, then received), and EnvPool's
    ``send`` / ``recv(1)``: every env's results reach the program once, in order."""
    pytest.importorskip("pettingzoo", minversion="1.24")  # (mlagents-envs 1.1.0 pins 1.15)
    outcome, stderr = run(VECTOR, tmp_path, lockstep=lockstep, per_worker=per_worker, seed=per_worker, interrupts=300)
    assert outcome["problems"] == [], (outcome, stderr)
    assert outcome["interrupts"] == 300 and outcome["taken"] > 0, outcome


# The SuperSuit drop-in (one row per agent, an env reset within the step that ended it, its agents' last
# observations in ``infos[row]["terminal_observation"]``): a step a Ctrl-C cut short is pending, as SB3's, and
# ``step_wait()`` returns it. Its envs are copies of one env: a seeded reset gives each its slot.
SUPERSUIT = textwrap.dedent(
    """
    import json, sys, tempfile
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import EnvRows, Presser, as_from_a_terminal, slowed
    as_from_a_terminal()
    import numpy as np
    from envmanager.errors import InvalidInputError
    from envmanager.pettingzoo import PettingZooVecEnv, concat_vec_envs, pettingzoo_env_to_vec_env, vector
    from pettingzoo_envs import SeededScheduleParallelEnv

    slowed(vector, "gather")  # the vector's batch handed out
    slowed(PettingZooVecEnv, "_observations")  # the drop-in's rows

    def main():
        n, agents, NONCE, sb3 = 4, EnvRows.AGENTS, EnvRows.NONCE, {base_class!r} == "stable_baselines3"
        envs = concat_vec_envs(pettingzoo_env_to_vec_env(SeededScheduleParallelEnv(0, tempfile.mkdtemp())), n,
                               num_cpus=2, base_class={base_class!r}, timeout=30)
        problems, interrupts = [], 0
        first = envs.reset(seed=0)  # env i: seed i, so slot i
        rows = EnvRows((first if sb3 else first[0]).reshape(n, agents, -1), problems)

        def take(got):
            obs, infos = got[0].reshape(n, agents, -1), got[-1]
            terminated = got[2].reshape(n, agents)  # (SB3's dones: none is truncated here)
            for i in range(n):
                o = obs[i]
                last = [infos[i * agents + a].get("terminal_observation") for a in range(agents)]
                if all(x is None for x in last):
                    rows.take(i, o, o[:, NONCE] != 0, terminated[i])  # (a row of an agent not there: zeros)
                elif not (o == rows.state[i][0]).all():  # (else its step and the reset after it are taken already)
                    # its episode ended in this step, and it was reset within it: the step, then the reset
                    there = np.array([x is not None for x in last])
                    rows.take(i, np.array([x if x is not None else o[a] for a, x in enumerate(last)]), there, terminated[i])
                    rows.take(i, o, np.ones(agents, bool), np.zeros(agents, bool))

        def pending(exc):  # the refusal that says a step is pending
            if "pending" not in str(exc):
                raise exc

        presser = Presser({seed})
        got, cut = None, False
        while interrupts < {interrupts} and not problems:
            try:
                if got is not None:  # (again, if a Ctrl-C cut it short)
                    take(got)
                    got = None
                if cut:  # the step a Ctrl-C cut short
                    got, cut = envs.step_wait(), False
                else:
                    got = envs.step(rows.actions(list(range(n))))
            except KeyboardInterrupt:
                interrupts += 1
            except InvalidInputError as exc:
                try:
                    pending(exc)
                    cut = True
                except InvalidInputError:
                    problems.append(repr(exc))
            except Exception as exc:
                problems.append(repr(exc))
        presser.stop()
        try:
            if not problems:
                if got is not None:
                    take(got)
                for _ in range(2):  # the step a Ctrl-C cut short, if one did, then a step of every env
                    try:
                        take(envs.step(rows.actions(list(range(n)))))
                    except InvalidInputError as exc:
                        pending(exc)
                        take(envs.step_wait())
                rows.in_step_with(envs.get_attr("episode")[::agents], envs.get_attr("t")[::agents])
        except Exception as exc:
            problems.append(repr(exc))
        envs.close()
        print(json.dumps({{"problems": problems[:5], "interrupts": interrupts, "taken": rows.taken}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("base_class", ["gymnasium", "stable_baselines3"])
def test_caught_ctrl_c_leaves_the_supersuit_dropin_in_step(base_class, tmp_path):
    pytest.importorskip("pettingzoo", minversion="1.24")  # (mlagents-envs 1.1.0 pins 1.15)
    if base_class == "stable_baselines3":
        pytest.importorskip("stable_baselines3")
    outcome, stderr = run(SUPERSUIT, tmp_path, base_class=base_class, seed=3, interrupts=300)
    assert outcome["problems"] == [], (outcome, stderr)
    assert outcome["interrupts"] == 300 and outcome["taken"] > 0, outcome


# What the ``MultiAgentSampler`` hands out, per agent episode (its rows say which env episode and step they are):
# each agent's steps consecutive from its episode's first, each action the policy's, one episode id per agent of
# one env episode; ``obtain_episodes``' episodes whole, each handed out once. A call a Ctrl-C cut short hands out
# nothing and the episodes it was recording are not recorded on (an agent episode's rows stop, with no gap). The
# same of the ``Sampler`` alone, on ``schedule_envs.ScheduleEnv`` (one agent).
SAMPLER = textwrap.dedent(
    """
    import json, sys, tempfile
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import Presser, as_from_a_terminal, slowed
    as_from_a_terminal()
    import numpy as np
    from envmanager.sampler import Sampler, TransitionBatch, WorkerPolicySampler
    from schedule_envs import ScheduleFactory, episode_length

    multi_agent = {multi_agent!r}
    slowed(TransitionBatch, "from_steps")  # the sampler's steps handed out (and the per-agent ones)
    slowed(TransitionBatch, "concatenate")  # (the WorkerPolicySampler's)
    if multi_agent:
        from envmanager.pettingzoo import MultiAgentSampler, agents
        from pettingzoo_envs import ScheduleParallelFn
        slowed(agents.AgentRows, "rows")  # the env steps into per-agent rows
        SLOT, AGENT, EPISODE, T, LAST, NONCE = range(6)
    else:  # the Sampler alone, on ``schedule_envs.ScheduleEnv`` (one agent)
        SLOT, EPISODE, T, LAST, NONCE, AGENT = 0, 1, 2, 3, 4, None

    def agent(o):
        return 0 if AGENT is None else int(o[AGENT])

    def policy(observations, acting):  # from the rows alone, so what an agent received can be checked
        return np.array([(o[T] + o[SLOT] + agent(o)) % 4 for o in observations], np.int64)

    class Agent:  # the policy as the WorkerPolicySampler's workers run it
        get_actions = staticmethod(policy)

    def main():
        n, steps, per_call = 4, {kind!r} == "steps", {per_call}
        if multi_agent:
            s = MultiAgentSampler([ScheduleParallelFn(i, tempfile.mkdtemp()) for i in range(n)], policy, seed=0,
                                  policy_in_workers={in_workers!r}, envs_per_worker=2, timeout=30)
        elif {in_workers!r}:  # the WorkerPolicySampler alone
            s = WorkerPolicySampler(ScheduleFactory(tempfile.mkdtemp()), n, Agent(), seed=0, envs_per_worker=2, timeout=30)
        else:
            s = Sampler(ScheduleFactory(tempfile.mkdtemp()), n, policy, seed=0, envs_per_worker=2, timeout=30)
        problems, interrupts = [], 0
        # Per agent episode id: its env episode (slot, agent, episode, nonce), its last step handed out and whether
        # it ended; and the number of the last sample taken. One store: a check cut short is done again as a whole.
        state = ({{}}, 0)

        def take(number, sample):
            seen, last = state
            if number == last:
                return state  # taken already
            seen, now = dict(seen), {{}}
            env_steps = sample.env_steps if multi_agent else sample
            if steps and len(env_steps) != per_call * (n if {in_workers!r} else 1):  # (in the workers: per slot)
                problems.append(f"obtain_steps({{per_call}}) handed out {{len(env_steps)}} env steps")
            for batch in sample.groups.values() if multi_agent else [sample]:
                obs, nxt = batch.observations, batch.next_observations
                for r, eid in enumerate(batch.episode_ids.tolist()):
                    o, x, a = obs[r], nxt[r], int(batch.actions[r])
                    who = (int(o[SLOT]), agent(o), int(o[EPISODE]), float(o[NONCE]))
                    what = f"agent episode {{eid}} (slot, agent, episode {{who[:3]}}): step {{int(o[T])}}"
                    known, t, ended = seen.get(eid, (who, -1, False))
                    if known != who:
                        problems.append(f"{{what}}: the id of another agent episode, {{known[:3]}}")
                    elif ended or (not steps and eid in seen and eid not in now):
                        problems.append(f"{{what}}: handed out again")
                    elif o[T] != t + 1:
                        problems.append(f"{{what}} after step {{t}}: a step lost, doubled or out of order")
                    elif a != (o[T] + o[SLOT] + agent(o)) % 4 or x[LAST] != a or x[T] != o[T] + 1:
                        problems.append(f"{{what}}: action {{a}}, the agent received {{x[LAST]}} at step {{x[T]}}")
                    elif batch.terminated[r] != (x[T] >= episode_length(who[0], who[2]) + who[1]) or batch.truncated[r]:
                        problems.append(f"{{what}}: terminated {{batch.terminated[r]}}, truncated {{batch.truncated[r]}}")
                    elif batch.interrupted[r]:
                        problems.append(f"{{what}}: interrupted, yet no worker restarted")
                    seen[eid] = now[eid] = (who, int(o[T]), bool(batch.terminated[r]))
            if not steps:
                problems.extend(f"agent episode {{eid}} {{who[:3]}}: handed out up to step {{t}} only"
                                for eid, (who, t, ended) in now.items() if not ended)
            return seen, number

        def obtain():
            return s.obtain_steps(per_call) if steps else s.obtain_episodes(per_call)

        presser = Presser({seed})
        got, number = None, 0
        while interrupts < {interrupts} and not problems:
            try:
                if got is not None:  # (again, if a Ctrl-C cut it short)
                    state = take(*got)
                    got = None
                number += 1
                got = (number, obtain())
            except KeyboardInterrupt:
                interrupts += 1
            except Exception as exc:
                problems.append(repr(exc))
        presser.stop()
        try:
            if not problems:
                if got is not None:
                    state = take(*got)
                state = take(number + 1, obtain())
        except Exception as exc:
            problems.append(repr(exc))
        s.close()
        print(json.dumps({{"problems": problems[:5], "interrupts": interrupts, "agent_episodes": len(state[0])}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize(("multi_agent", "in_workers", "kind", "per_call"),
                         [(True, False, "steps", 2), (True, False, "episodes", 1), (True, True, "steps", 2),
                          (False, False, "steps", 2), (False, False, "episodes", 1), (False, True, "steps", 2)])
def test_caught_ctrl_c_leaves_the_samplers_in_step(multi_agent, in_workers, kind, per_call, tmp_path):
    """``MultiAgentSampler.obtain_steps`` (episodes going on from call to call), with the policy
    in the parent and in the workers, and ``obtain_episodes``; the ``Sampler`` and the
    ``WorkerPolicySampler`` under it alone."""
    if multi_agent:
        pytest.importorskip("pettingzoo", minversion="1.24")  # (mlagents-envs 1.1.0 pins 1.15)
    interrupts = 1000 if multi_agent else 600
    outcome, stderr = run(SAMPLER, tmp_path, multi_agent=multi_agent, in_workers=in_workers, kind=kind,
                          per_call=per_call, seed=4, interrupts=interrupts)
    assert outcome["problems"] == [], (outcome, stderr)
    assert outcome["interrupts"] == interrupts and outcome["agent_episodes"] > 0, outcome


# The ``WorkerPolicySampler`` with restarts off: an env raises in slot 1's fragment while slot 0's (slow, another
# process) is still out, and a Ctrl-C lands as that answer's fault is about to be decided. The Ctrl-C is the
# caller's; the env's error must not be lost with it (the next call raises it), and the steps stay counted.
FAULT_UNDER_CTRL_C = textwrap.dedent(
    """
    import json, os, signal, sys, tempfile, time
    sys.path[:0] = [{repo!r}, {tests!r}]
    from interrupt_helpers import as_from_a_terminal
    as_from_a_terminal()
    import numpy as np
    from envmanager.errors import WorkerError
    from envmanager.sampler import WorkerPolicySampler
    from fault_envs import FaultFactory

    class Agent:
        def get_actions(self, observations, worker_ids):
            return np.zeros(len(worker_ids), np.int64)

    factory = FaultFactory("step_raise", os.path.join(tempfile.mkdtemp(), "struck"), step_s=0.05, slow=(0,))
    s = WorkerPolicySampler(factory, 2, Agent(), seed=0, restart_workers=False, timeout=30)
    fault = s._fault

    def pressing(*args, **kwargs):  # Ctrl-C as the answer's fault is about to be put to the pool
        s._fault = fault
        signal.raise_signal(signal.SIGINT)
        return fault(*args, **kwargs)

    s._fault = pressing
    outcomes, handed = [], 0
    for _ in range(3):
        try:
            try:
                handed += len(s.obtain_steps(12))  # slot 1 raises at the 2nd step of its 2nd episode (within 10)
                outcomes.append("rows")
            except WorkerError as exc:
                outcomes.append(f"WorkerError of slot {{exc.worker_id}}")
                time.sleep(0.5)  # (slot 0's answer came first: the error was raised, the Ctrl-C comes after it)
        except KeyboardInterrupt:
            outcomes.append("KeyboardInterrupt")
    c = s.stats.counters
    s.close()
    print(json.dumps({{"outcomes": outcomes, "failed_episodes": c.get("failed_episodes", 0),
                      "env_steps": c["env_steps"], "handed_and_dropped": handed + c.get("dropped_steps", 0)}}))
    """
)


def test_a_ctrl_c_over_a_worker_policy_fault_loses_no_error(tmp_path):
    """A Ctrl-C that lands while the ``WorkerPolicySampler`` files an answer that carries an env's
    error: the call ends with the ``KeyboardInterrupt``, the next one raises the env's error
    (before, the fault was never decided and the error lost: later calls went on on the env that
    raised), and every step the envs took is counted."""
    outcome, stderr = run(FAULT_UNDER_CTRL_C, tmp_path, timeout=120)
    assert outcome["outcomes"] in (["KeyboardInterrupt", "WorkerError of slot 1", "rows"],  # (slot 0's fragment still out)
                                   ["WorkerError of slot 1", "KeyboardInterrupt", "rows"]), (outcome, stderr)
    assert outcome["failed_episodes"] == 1, outcome
    assert outcome["env_steps"] == outcome["handed_and_dropped"], outcome


# ML-Agents: fake players echo the action they received; the policy notes which step each action was chosen from.
# Each step handed out must answer an action chosen from the worker's step handed out before it (none lost, doubled
# or out of order), and the agent manager must get each reset's steps once. The manager's work after the core's last
# section (each result made a step, the trainer's add_experiences) is slower than the grace on every third call.
MLAGENTS = textwrap.dedent(
    """
    import json, os, sys, tempfile
    sys.path[:0] = [{repo!r}, {tests!r}]
    os.environ["RAY_USAGE_STATS_ENABLED"], os.environ["RAY_AUTH_MODE"] = "0", "disabled"
    from interrupt_helpers import Presser, as_from_a_terminal, slowed
    import numpy as np
    from mlagents_envs.base_env import ActionTuple
    from envmanager.mlagents import ActionInfo, MLAgentsEnvManager, UnityEnvironmentFactory
    from envmanager.testing.fake_unity import free_base_port, write_launcher

    B, N = "FakeBehavior?team=0", 2
    slowed(MLAgentsEnvManager, "_environment_step")

    class Policy:
        def __init__(self):
            self.calls, self.chosen_from = 0, {{}}  # action -> the echo of the step it was chosen from

        def get_action(self, decision_steps, worker_id):
            self.calls += 1
            action = np.float32(100_000 * worker_id + self.calls)
            self.chosen_from[float(action)] = float(decision_steps.obs[1][0, 0])
            return ActionInfo.for_steps(decision_steps, ActionTuple(continuous=np.full((1, 1), action)), {{}})

    class AgentManager:
        def __init__(self):
            self.added = []

        def add_experiences(self, decision_steps, terminal_steps, worker_id, action_info):
            self.added.append((worker_id, float(decision_steps.obs[1][0, 0])))

    slowed(AgentManager, "add_experiences")

    def main():
        tmp = tempfile.mkdtemp()
        path = write_launcher(tmp, {{"step_latency": 0.001, "behaviors": [{{"agents": 1, "continuous": 1, "discrete": [],
            "observation_shapes": [[1], [1]], "echo_actions": True, "episode_length": 0}}]}}, "fakeplayer")
        factory = UnityEnvironmentFactory(path, base_port=free_base_port(N), timeout_wait=10)
        if {ray!r}:
            import ray
            from envmanager.mlagents import RayMLAgentsEnvManager
            ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rayt"), log_to_driver=False)
            m = RayMLAgentsEnvManager(factory, N, n_nodes=2, timeout=30)
        else:
            m = MLAgentsEnvManager(factory, N, timeout=30)
        as_from_a_terminal()
        policy, agent_manager = Policy(), AgentManager()
        m.set_policy(B, policy)
        m.set_agent_manager(B, agent_manager)
        problems, interrupts, steps = [], 0, 0

        def retried(call):  # as a program that goes on after a Ctrl-C it caught
            nonlocal interrupts
            while True:
                try:
                    return call()
                except KeyboardInterrupt:
                    interrupts += 1

        presser = Presser({seed})
        while interrupts < {interrupts} and not problems:
            before = len(agent_manager.added)
            retried(m.reset)
            last = dict.fromkeys(range(N), 0.0)  # the echo of each worker's last step handed out (a reset's: 0)
            for _ in range(20):
                for step in retried(m.get_steps):
                    w, info = step.worker_id, step.brain_name_to_action_info[B]
                    echo, sent = float(step.current_all_step_result[B][0].obs[1][0, 0]), float(info.env_action.continuous[0, 0])
                    if echo != sent or policy.chosen_from[echo] != last[w]:
                        problems.append(f"worker {{w}}: a step answering {{sent}}, the player got {{echo}}, chosen from the "
                                        f"step echoing {{policy.chosen_from.get(echo)}}; the one handed out before: {{last[w]}}")
                    last[w], steps = echo, steps + 1
            resets = sorted(w for w, echo in agent_manager.added[before:] if echo == 0.0)
            if resets != list(range(N)):
                problems.append(f"the agent manager got the reset steps of workers {{resets}}")
        presser.stop()
        m.close()
        print(json.dumps({{"problems": problems[:5], "interrupts": interrupts, "steps": steps}}))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("on_ray", [False, True])
def test_caught_ctrl_c_leaves_the_mlagents_manager_in_step(on_ray, tmp_path):
    """``get_steps`` lost the steps it had taken (the policy then acted on a step the trainer
    never saw, within 10 presses), and ``reset``'s steps reached the agent managers twice."""
    pytest.importorskip("mlagents_envs")
    if on_ray:
        pytest.importorskip("ray")
    outcome, stderr = run(MLAGENTS, tmp_path, ray=on_ray, seed=5, interrupts=300)
    assert outcome["problems"] == [], (outcome, stderr)
    assert outcome["interrupts"] >= 300 and outcome["steps"] > 0, outcome
