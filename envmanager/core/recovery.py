"""``PoolRecovery``: the failure path of :class:`~envmanager.core.pool.WorkerPool`.

Every fault of a process (it died, hung, raised, an env of it raised) is put to the pool's
:class:`~envmanager.core.supervisor.Supervisor`; this half carries its decision out: restart (kill,
start anew told its slots' new generations, and the boot plan: attach, the replayed calls, a
reset that answers what was in flight, ``interrupted``), rebuild the envs that raised in it
(``envmanager.core.rebuild``), or give up. Kept apart from the pool's transport (sending, the
answers' hot path, closing); a mixin of ``WorkerPool`` (no call added to the hot path).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from envmanager.core.completion import Completion, worker_error
from envmanager.core.process import Boot, WorkerProcess
from envmanager.core.rebuild import delivered, rebuild_request
from envmanager.core.supervisor import Decision, Fault, GiveUp, Rebuild, Restart, Supervisor
from envmanager.errors import EnvManagerError, InvalidInputError, ManagerClosedError, WorkerDiedError, WorkerTimeoutError
from envmanager.wire.messages import Attach, Call, EnvironmentRequest, Reset, Stepped
from envmanager.wire.messages import EnvironmentCommand as Cmd
from envmanager.wire.shm import SharedBuffers
from envmanager.wire.transport import PortableAnswers, StepQueue
from envmanager.worker.main import WorkerSpec

__all__ = ["PoolRecovery"]

_RESETS = (Cmd.RESET, Cmd.REBUILD)  # requests that carry a seed and options per env
_ANSWERED_BY_RESET = (Cmd.STEP, Cmd.RESET, Cmd.REBUILD)  # by a restart's fresh reset, ``interrupted``


class PoolRecovery:
    """Restarts, rebuilds and give-ups of ``WorkerPool``'s processes (see the module doc)."""

    # The pool's state this half works on (set by ``WorkerPool.__init__``).
    supervisor: Supervisor
    workers: list[WorkerProcess]
    buffers: SharedBuffers | None
    replay_calls: list[tuple[str, tuple, dict]]
    queue: StepQueue | PortableAnswers | None
    _version: int

    if TYPE_CHECKING:  # the pool's own methods
        def prepare(self, cmd: Cmd, message: Any, slots: tuple[int, ...] = ()) -> EnvironmentRequest:
            ...

        def _start(self, spec: WorkerSpec, boot: Boot | None = None) -> WorkerProcess:
            ...

    def fault(self, index: int, error: EnvManagerError, envs: tuple[int, ...] = (), seen: dict[int, int] | None = None
              ) -> Decision:
        """A failure of process ``index`` its caller found in an answer of the generations ``seen``
        (an env update that raised in a call; a worker-side rollout's ``envs``, to be rebuilt in
        place and remade by the caller's own next call, ``WorkerEnvs.rebuild``): the supervisor's
        decision, carried out — or the one taken already, if those envs were replaced since."""
        w = self.workers[index]
        if w.failure is not None:
            return GiveUp(w.failure, True)
        decided = self.supervisor.already(index, seen or {})
        if decided is not None:
            return decided
        if w.busy:
            raise InvalidInputError(f"{w.name} has a request in flight; report a failure once it answered")
        decision = self._decide(w, error, None, envs)
        return decision if isinstance(decision, Rebuild) else self._carry_out(w, decision, error, [], [])

    def join_boot(self, index: int, cmd: Cmd, slots: tuple[int, ...], reset: Reset | None = None) -> None:
        """A step or reset of ``slots`` (idle) asked while process ``index`` comes back from a
        restart (``boot`` set): its boot's fresh reset answers them, ``interrupted`` (``Boot.join``).
        Nothing goes to the worker, which would take it ahead of its plan."""
        boot = self.workers[index].boot
        assert boot is not None and not boot.startup, "only a running pool's restart is joined"
        boot.join(cmd, slots, reset)

    def _on_failure(self, w: WorkerProcess, error: EnvManagerError, completions: list[Completion],
                    request: EnvironmentRequest | None = None) -> None:
        """``w`` failed (``request``, already out of flight, with it): restarted or given up."""
        self._carry_out(w, self._decide(w, error, request), error, [request] if request is not None else [], completions)

    def _decide(self, w: WorkerProcess, error: EnvManagerError, request: EnvironmentRequest | None = None,
                envs: tuple[int, ...] = ()) -> Decision:
        """The supervisor's decision on ``w``'s failure; ``envs`` (which raised) are rebuilt in
        place if it serves on: alive, answering, not on its way back nor rebuilding."""
        if self.queue is None:  # closed meanwhile by another thread: nothing is restarted
            raise ManagerClosedError("the SubprocessEnvManager was closed")
        self._version += 1
        rebuilding = request is not None and request.cmd is Cmd.REBUILD  # (an env it could not rebuild is gone)
        serves = not (isinstance(error, (WorkerDiedError, WorkerTimeoutError)) or not w.alive() or w.boot is not None
                      or rebuilding)
        envs = envs if serves else ()
        what = f"rebuilding env {', '.join(map(str, envs))} of" if envs else "restarting"
        return self.supervisor.on_fault(w.index, Fault(error, f"{what} {w.name} after: {error}", serves, envs))

    def _carry_out(self, w: WorkerProcess, decision: Decision, error: EnvManagerError, lost: list[EnvironmentRequest],
                   completions: list[Completion]) -> Decision:
        """A restart or give-up of ``w`` after ``error``: every request in flight is cut short
        with it (``lost`` are already out of flight) and answered by the restart, or by the
        decision's error; a process that serves on (restarts off) reports it for ``lost`` alone."""
        if isinstance(decision, GiveUp) and not decision.given_up:
            requests: list[EnvironmentRequest | None] = [*lost] or [None]
            completions += [Completion(w, r, None, decision.error) for r in requests]
            return decision
        lost += w.cut()
        if w.boot is not None:  # a restart failed on its way up: what it was answering is what failed
            lost = list(w.boot.lost)
        if isinstance(decision, Restart):
            self._restart(w, lost, error, decision.generations, completions)
            return decision
        w.fail()
        assert isinstance(decision, GiveUp)
        requests = [*lost] or [None]
        for lost_request in requests:  # the same error for each (the slots file it once)
            completions.append(Completion(w, lost_request, None, decision.error))
        return decision

    def _restart(self, w: WorkerProcess, lost: list[EnvironmentRequest], error: EnvManagerError,
                 generations: tuple[int, ...], completions: list[Completion]) -> None:
        """Replace ``w`` by a new process, told its envs' ``generations``, and plan how it comes
        back (see ``Boot``); the supervisor recorded the restart."""
        w.kill()
        attach = [(Cmd.ATTACH, Attach(self.buffers.layout))] if self.buffers else []
        startup = [r for r in lost if r.cmd in (Cmd.READY, Cmd.ATTACH)]
        if w.boot is not None:  # it failed again while coming back: the same way up, from the start
            boot = Boot(w.boot.all_steps, w.boot.lost, w.boot.startup)
        elif startup:
            # Failed while the pool was starting: the new process answers the startup instead.
            boot = Boot(attach if startup[0].cmd is Cmd.ATTACH else [], startup, True)
        else:
            everyone = tuple(range(len(w.env_ids)))
            replays = [(Cmd.CALL, Call(everyone, n, a, k)) for n, a, k in self.replay_calls]
            asked: dict[int, tuple[Any, Any]] = {}  # every env is reset; those being reset keep their seeds and options
            for r in lost:
                if r.cmd in _RESETS:
                    m = r.message
                    asked.update({i: (seed, options) for i, seed, options in zip(m.locals, m.seeds, m.options, strict=True)})
            reset = Reset(everyone, tuple(asked.get(i, (None, None))[0] for i in everyone),
                          tuple(asked.get(i, (None, None))[1] for i in everyone))
            # Steps, resets and rebuilds are answered by the fresh reset (``interrupted``); a call is not.
            answered = [r for r in lost if r.cmd in _ANSWERED_BY_RESET]
            for r in lost:
                if r.cmd not in _ANSWERED_BY_RESET:
                    completions.append(Completion(w, r, None, error))  # its caller must know
            boot = Boot([*attach, *replays, (Cmd.RESET, reset)], answered, False)
        self.workers[w.index] = self._start(replace(w.spec, generations=generations), boot)

    def _env_failed(self, w: WorkerProcess, request: EnvironmentRequest, answer: Stepped, completion: Completion,
                    completions: list[Completion]) -> bool:
        """Envs raised in ``request`` (``answer.failures``): the supervisor decides. Rebuilt in
        their process, which answered (``envmanager.core.rebuild``): the other envs' results
        stand. Else restarted or given up; or (``False``) the process serves on and
        ``completion`` is filed as it is (restarts off: the failures are those envs' errors)."""
        failures = answer.failures
        assert failures is not None
        error = worker_error(failures[min(failures)], w.index)
        slots = request.slots
        decision = self._decide(w, error, request,
                                tuple(slots[n] for n in sorted(failures)) if request.cmd in (Cmd.STEP, Cmd.RESET) else ())
        if isinstance(decision, GiveUp) and not decision.given_up:
            return False
        if not isinstance(decision, Rebuild):
            self._carry_out(w, decision, error, [request], completions)
            return True
        kept = [n for n in range(len(slots)) if n not in failures]
        if kept:  # the envs that delivered: their results, as if the others were not asked
            completion.keep(delivered(answer, kept, slots), tuple(slots[n] for n in kept))
            completions.append(completion)
        w.rebuild(rebuild_request(self.prepare, w.env_ids, request, sorted(failures), self.replay_calls,
                                  decision.generations))
        return True

    def _rebuilt(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """An answer of a process rebuilding envs: a rebuild's is those slots' fresh reset,
        ``interrupted`` (as a restart's is for every slot of its process)."""
        request = completion.request
        if request is not None and request.cmd is Cmd.REBUILD:
            completion.answering((request,))
        w.rebuilt()
        completions.append(completion)

    def _advance_boot(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """Take a replacement process through its plan (attach → replayed calls → reset)."""
        boot = w.boot
        assert boot is not None
        step = boot.next()
        if step is not None:
            cmd, message = step
            locals_ = getattr(message, "locals", None)
            slots = w.env_ids if locals_ is None else tuple(w.env_ids[i] for i in locals_)
            w.send(self.prepare(cmd, message, slots))
            return
        completion.answering(tuple(boot.lost), not boot.startup)
        w.running()
        completions.append(completion)
