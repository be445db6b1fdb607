"""``PoolRecovery``: the failure path of :class:`~envmanager.core.pool.WorkerPool`.

A process that died, hung or raised is restarted (killed, started anew, and taken through its
boot plan: attach, the replayed calls, a reset that answers what was in flight, ``interrupted``)
or, past the restart policy, given up with its terminal error; an env that raised in a step or
reset of a healthy process is rebuilt there instead (``envmanager.core.rebuild``). The decisions
are the pool's :class:`~envmanager.core.supervisor.Supervisor`'s. Kept apart from the pool's
transport (sending, the answers' hot path, closing) so each half reads on its own; a mixin of
``WorkerPool`` (the same object and methods, no call added to the hot path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envmanager.core.completion import Completion, error_slot, worker_error
from envmanager.core.process import Boot, ProcessState, WorkerProcess
from envmanager.core.rebuild import EnvRebuilds, delivered
from envmanager.core.supervisor import Supervisor
from envmanager.errors import EnvManagerError, RestartLimitError, WorkerDiedError, WorkerTimeoutError
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
    rebuilds: EnvRebuilds
    queue: StepQueue | PortableAnswers | None
    _version: int

    if TYPE_CHECKING:  # the pool's own methods
        def prepare(self, cmd: Cmd, message: Any, slots: tuple[int, ...] = ()) -> EnvironmentRequest:
            ...

        def _start(self, spec: WorkerSpec, boot: Boot | None = None, generation: int = 0) -> WorkerProcess:
            ...

    def generation(self, slot: int, process: int) -> int:
        """How often ``slot``'s env was replaced: its process restarted, or itself rebuilt."""
        return self.workers[process].generation + self.rebuilds.counts[slot]

    def report_failure(self, index: int, error: EnvManagerError) -> EnvManagerError | None:
        """A failure of process ``index`` that its caller found in an answer (an env that raised
        inside a call that steps the envs, say): handled as the pool handles one it finds
        itself. Returns ``None`` when the process is being restarted (its fresh reset comes back
        ``interrupted``), else the error to raise (``RestartLimitError`` past the limits)."""
        w = self.workers[index]
        if w.failure is not None:
            return w.failure
        completions: list[Completion] = []
        self._on_failure(w, error, completions)
        return next((c.error for c in completions if c.error is not None), None)

    def join_boot(self, index: int, cmd: Cmd, slots: tuple[int, ...], reset: Reset | None = None) -> None:
        """A step or reset of ``slots`` (idle) asked while process ``index`` comes back from a
        restart (``boot`` set): its boot's fresh reset answers them, ``interrupted``, as it
        answers what the failure cut short. Nothing goes to the worker, which would take it
        ahead of its plan. A reset's seeds and options go into the boot's reset (a second reset
        of every env, if the first was sent already)."""
        boot = self.workers[index].boot
        assert boot is not None and not boot.startup, "only a running pool's restart is joined"
        if reset is not None and any(v is not None for v in (*reset.seeds, *reset.options)):
            final = boot.all_steps[-1][1]
            assert isinstance(final, Reset)  # (a boot's plan ends with the reset of every env)
            seeds = dict(zip(final.locals, final.seeds, strict=True))
            options = dict(zip(final.locals, final.options, strict=True))
            seeds.update(zip(reset.locals, reset.seeds, strict=True))
            options.update(zip(reset.locals, reset.options, strict=True))
            merged = (Cmd.RESET, Reset(final.locals, tuple(seeds[i] for i in final.locals),
                                       tuple(options[i] for i in final.locals)))
            boot.all_steps[-1] = merged  # (the plan again, should this process fail on its way up)
            if boot.plan:  # not sent yet
                boot.plan[-1] = merged
            else:
                boot.plan.append(merged)
        boot.lost.append(EnvironmentRequest(cmd, -1, slots))

    def rebuild_in_place(self, index: int, slots: list[int], error: EnvManagerError) -> EnvManagerError | None:
        """Envs ``slots`` of process ``index`` raised inside a call the process answered (so it
        is healthy): within the restart policy each is to be rebuilt in that process, counted as
        a restart now, its slot's generation raised now (``None`` is returned); the caller's own
        code in the worker remakes it before its next use (``WorkerEnvs.rebuild``, as a REBUILD
        would). A process on its way back, or a refusal of the policy, take the process's
        failure path instead (``report_failure``)."""
        w = self.workers[index]
        if w.failure is not None:
            return w.failure
        if w.boot is not None or self.queue is None or self.supervisor.refusal(index) is not None:
            return self.report_failure(index, error)
        self.supervisor.restarting(index, f"rebuilding env {', '.join(map(str, slots))} of {w.name} after: {error}")
        for s in slots:
            self.rebuilds.counts[s] += 1
        return None

    def _on_failure(
        self, w: WorkerProcess, error: EnvManagerError, completions: list[Completion], request: EnvironmentRequest | None = None
    ) -> None:
        """Restart ``w`` if the policy allows; otherwise report ``error`` for every request the
        failure cut short (``request``, already out of flight, and those still in flight)."""
        self._version += 1
        lost = [request] if request is not None else []
        if self.queue is None:  # closing: nothing is restarted
            refused: EnvManagerError | None = error
        else:
            refused = self.supervisor.decide(w.index, f"restarting {w.name} after: {error}",
                                             lambda reason: self._refused(w, reason, error))
        restart = refused is None
        error = refused or error
        # (a process that could not rebuild an env is given up too: that env is gone)
        rebuilding = request is not None and request.cmd is Cmd.REBUILD
        gone = isinstance(error, (WorkerDiedError, WorkerTimeoutError)) or not w.alive() or w.boot is not None or rebuilding
        if restart or gone:  # the process goes: every request in flight is cut short with it
            lost += w.cut()
            if w.boot is not None:  # a restart failed on its way up: what it was answering is what failed
                lost = list(w.boot.lost)
        if restart:
            self._restart(w, lost, error, completions)
            return
        if gone:  # the process is gone or stuck for good: its error, on every later use
            error = self.supervisor.give_up(w.index, error)
            w.fail()
        requests: list[EnvironmentRequest | None] = [*lost] or [None]
        for lost_request in requests:  # the same error for each (the slots file it once)
            completions.append(Completion(w, lost_request, None, error))

    def _refused(self, w: WorkerProcess, reason: str, error: EnvManagerError) -> EnvManagerError:
        """The error of a process the policy does not restart: past the limits, ``RestartLimitError``
        naming the slot, the process and the failure; with restarts off, the failure itself."""
        if not self.supervisor.policy.enabled:
            return error
        return RestartLimitError(error_slot(error, w), reason, error, w.env_ids, w.index)

    def _restart(self, w: WorkerProcess, lost: list[EnvironmentRequest], error: EnvManagerError,
                 completions: list[Completion]) -> None:
        """Replace ``w`` by a new process and plan how it comes back (see ``Boot``); the
        supervisor recorded the restart."""
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
        self.workers[w.index] = self._start(w.spec, boot, w.generation + 1)

    def _env_failed(self, w: WorkerProcess, request: EnvironmentRequest, answer: Stepped, completion: Completion,
                    completions: list[Completion]) -> None:
        """Restarts are on and envs raised in ``request`` (``answer.failures``): rebuild them in
        their process, which answered and so is healthy, counted as a restart by the policy
        (``envmanager.core.rebuild``); the other envs' results stand (their episodes go on). A
        process on its way back, a rebuild's own answer, or a refusal of the policy take the
        process's failure path instead (restarted, or ``RestartLimitError``)."""
        failures = answer.failures
        assert failures is not None
        error = worker_error(failures[min(failures)], w.index)
        if request.cmd not in (Cmd.STEP, Cmd.RESET) or w.boot is not None or self.supervisor.refusal(w.index) is not None:
            self._on_failure(w, error, completions, request)
            return
        slots = request.slots
        kept = [n for n in range(len(slots)) if n not in failures]
        if kept:  # the envs that delivered: their results, as if the others were not asked
            completion.answer, completion.slots = delivered(answer, kept, slots), tuple(slots[n] for n in kept)
            completions.append(completion)
        rebuild = self.rebuilds.request(self.prepare, w.env_ids, request, sorted(failures), self.replay_calls)
        self.supervisor.restarting(w.index, f"rebuilding env {', '.join(map(str, rebuild.slots))} of {w.name} after: {error}")
        w.state = ProcessState.REBUILDING
        w.send(rebuild)

    def _rebuilt(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """An answer of a process rebuilding envs: a rebuild's is those slots' fresh reset,
        ``interrupted`` (as a restart's is for every slot of its process)."""
        request = completion.request
        if request is not None and request.cmd is Cmd.REBUILD:
            completion.interrupted = True
            completion.lost = (request,)
        if not any(r.cmd is Cmd.REBUILD for r, _ in w.requests):
            w.state = ProcessState.RUNNING
        completions.append(completion)

    def _advance_boot(self, w: WorkerProcess, completion: Completion, completions: list[Completion]) -> None:
        """Take a replacement process through its plan (attach → replayed calls → reset)."""
        boot = w.boot
        assert boot is not None
        if boot.plan:
            cmd, message = boot.plan.pop(0)
            locals_ = getattr(message, "locals", None)
            slots = w.env_ids if locals_ is None else tuple(w.env_ids[i] for i in locals_)
            w.send(self.prepare(cmd, message, slots))
            return
        completion.interrupted = not boot.startup
        completion.request = boot.lost[0] if boot.lost else None
        completion.lost = tuple(boot.lost)
        w.boot = None
        w.state = ProcessState.RUNNING
        completions.append(completion)
