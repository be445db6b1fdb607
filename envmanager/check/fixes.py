"""How to fix each problem ``envmanager check`` names: the advice text, in one place."""

from __future__ import annotations

CANNOT_TRAVEL = (
    "Make the factory a module-level function (or functools.partial of one) of an importable module that "
    "builds everything inside the worker: pass settings, not live objects (envs, simulators, locks, sockets, "
    "open files). The chain above shows what holds what.")


def cannot_travel_in_worker(exc_type: str) -> str:
    return ("A spawn or forkserver worker is a fresh interpreter: it imports the factory's module by name. Make "
            "that module importable there (install your package, or put its folder on PYTHONPATH), define the "
            "factory at module level rather than in a module loaded from a path, or send it by value with "
            "cloudpickle.register_pickle_by_value(module). fork workers copy this process, so they hide this; "
            "macOS and Windows use spawn.")


def not_built(exc_type: str) -> str:
    if exc_type.rsplit(".", 1)[-1] in ("NameNotFound", "NamespaceNotFound", "VersionNotFound", "UnregisteredEnv"):
        return ("The env id is registered in this process only (a gymnasium.register call under "
                "`if __name__ == '__main__':`, or in code a fresh worker does not run). Register it at import time "
                "of the module that defines the env and make the factory import that module, or use gymnasium's "
                "'module:EnvId' form, which imports the module in every worker.")
    return ("Building the env in a worker failed (the traceback says where). Whatever the factory needs must be "
            "set up by the factory itself or at import time of its modules: a worker started with spawn or "
            "forkserver runs none of this process's run-time setup.")


NOT_REPRODUCIBLE = (
    "Seed every source of randomness from reset's seed: call super().reset(seed=seed) and draw from "
    "self.np_random, not from np.random, random, or an unseeded default_rng(); seed simulators and inner envs "
    "from it. Until then no run is reproducible, in a worker or not.")

DIFFERS_ACROSS = (
    "Something differs per process: Python's str hashing (hash(), the order of sets of strings: randomized in "
    "every spawn/forkserver worker unless PYTHONHASHSEED is set), os.getpid(), the clock, os.urandom, or an RNG "
    "seeded from them. Derive everything random from reset's seed (self.np_random) and do not let hash() or set "
    "order decide anything.")


def differs_in_worker(method: str) -> str:
    if method == "fork":
        return ("A fork worker differs from this process: the env depends on the process it runs in (its pid, "
                "the clock, or state this process changed after the worker started). Derive everything from "
                "reset's seed and the factory's arguments.")
    return ("A fresh worker lacks what this process set up at run time: module globals changed after import, "
            "envs configured under `if __name__ == '__main__':`, class attributes or environment variables set "
            "by your script. spawn and forkserver workers import your modules afresh (fork workers copy this "
            "process, which hides it; macOS and Windows use spawn). Do that setup inside the factory or at import "
            "time of the env's module, or pass it as the factory's arguments. Or something is drawn per interpreter "
            "(str hashing: forkserver workers share their server's, spawn workers each have their own): derive "
            "everything random from reset's seed.")


OUTPUTS = {
    "observation-dtype": (
        "Return observations of the declared dtype (np.asarray(obs, dtype=self.observation_space.dtype)) or "
        "declare the dtype you return. Vector envs store observations in arrays of the declared dtype, so values "
        "are rounded or wrap around silently."),
    "observation-shape": (
        "Return observations of the declared shape, or declare the shape you return: shared-memory vector envs "
        "(envmanager, gymnasium's AsyncVectorEnv) cannot store another shape."),
    "observation-out-of-bounds": (
        "Keep observations inside the declared bounds (np.clip, or correct low/high): normalizers and policies "
        "that trust the bounds see values outside them, and nothing on the way clips them."),
    "observation-not-in-space": "Return observations that the observation space contains (space.contains(obs)).",
    "reward-not-scalar": "Return the reward as a Python float (float(reward)), not an array or another type.",
    "flags-not-bool": "Return terminated and truncated as bools (bool(flag)).",
    "info-not-dict": "Return a dict as info (an empty one if there is nothing to say).",
    "info-not-picklable": (
        "Infos cross the process boundary pickled: put plain data in them (numbers, strings, arrays), not "
        "handles, locks, generators or the env itself."),
}

DELIVERY = (
    "The env's result cannot reach the parent (the worker's traceback says why): return plain data that "
    "pickles, of the declared spaces.")

RAISES = (
    "reset and step must accept what the spaces allow: here they raised with sampled actions right after "
    "reset(seed=...). Fix the env, or make its action space say what it accepts.")

EXCEPTION_PICKLE = (
    "An exception class whose __init__ takes other arguments than the message does not unpickle "
    "(Exception.__reduce__ passes self.args back). Call super().__init__(*all_your_arguments), or define "
    "__reduce__; otherwise the parent gets only a traceback, and `except YourError:` around a vector env "
    "catches nothing.")

HANGS = (
    "Every reset and step must return: put a timeout on whatever the env waits for (sockets, simulators, "
    "queues, locks), and make close() stop what it waits on. envmanager turns a hang into WorkerTimeoutError "
    "after its deadline; in this process a hang would stop your trainer.")

DIED = (
    "The env crashed its process (a segfault or an exit in native code). In a worker that is an error "
    "(WorkerDiedError, or a restart with restart_workers=True); in this process it would end your trainer.")

DIED_AT_START = (
    "A spawn or forkserver worker that exits with code 1 as it starts has usually re-run your script: it imports "
    "the main module, and code that starts processes (or runs the check) outside `if __name__ == '__main__':` "
    "runs again there. Put it under the guard (see the worker's stderr above for its own traceback).")

GYM_CHECKER = "Fix what gymnasium's check_env says (gymnasium.utils.env_checker.check_env(env) runs it locally)."

LEAKS = {
    "leaks-processes": (
        "close() must end what the env started: terminate the simulator or helper and wait for it "
        "(process.terminate(); process.wait(timeout)). envmanager's workers kill what they started when they "
        "close, but gymnasium's vector envs and plain use in your process do not."),
    "leaks-threads": (
        "close() must stop the threads the env started and join them (thread.join(timeout)); a non-daemon thread "
        "left running also keeps Python from exiting."),
    "leaks-fds": (
        "close() must close the files, sockets and pipes the env opened (use `with`, or close them in close()); "
        "each env built and closed leaves more behind."),
    "leaks-shared-memory": (
        "close() must close and unlink the shared memory the env created (SharedMemory.close() and .unlink()): "
        "segments in /dev/shm outlive every process until they are removed."),
}
