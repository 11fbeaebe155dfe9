"""Running one call through the state machine: routing → executing → formatting → done.

``CallRunner`` owns every state move of a call and runs the per-call hooks at each stage; ``WorkerCore``
is what a call needs from its worker process. Every move goes through the worker's outbox and is fenced by
the call's attempt number, so a worker that lost its lease can no longer move the call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog

from broker import keys, logs, pipes
from broker.audit import AuditLog
from broker.calls import WRONG_STATE, CallInfo, Calls, Claimed, Step, envelope_of, failure_entry, push_failure
from broker.codec import pack, text
from broker.config import Settings, load_settings
from broker.directory import Directory
from broker.durability import Confirmer
from broker.envelope import Envelope, concurrency_key, plugins_applied
from broker.errors import BudgetExceeded, CallCancelled, CallFailed, DecodeError, HermesError, OutputTooLarge
from broker.events import PROGRESS
from broker.otel import new_span_id
from broker.ratelimits import RateLimiter
from broker.states import State
from broker.toolspec import ToolSpec
from middleware import LLMCallFlow, PluginManager, ToolCallFlow
from middleware.plugins import NAMESPACE as PLUGIN_NAMESPACE
from workers import otelsdk, policy_store, retry, telemetry
from workers.args import check_output, coerce_args
from workers.executors import DEFAULT_MAX_OUTPUT, ExecContext, get_executor, run_executor
from workers.hooks import AuditRecordHook, CallLog, Checks, Circuit, Hook, Writer, hooked
from workers.llm import DEFAULT_PAUSE, PAUSE_STATUSES, RATE_RETURNS, LLMCall, RateLimited, describe_response
from workers.outbox import Outbox
from workers.policy import Policy
from workers.retry import RetryScheduler
from workers.telemetry import NO_TRACE, CallMetrics, CallSpans, CallTrace, NoTrace, Usage

log = structlog.get_logger("hermes.worker")

INLINE_RESULT_LIMIT = 64 * 1024

# The call's context a tool's middleware sees (``middleware/kinds.py`` normalises it).
TOOL_CONTEXT = ("session_id", "task_id", "turn_id", "api_request_id", "provider", "model", "api_mode", "tool_call_id")


@dataclass
class Running:
    """A call in flight in this process."""

    info: CallInfo
    env: Envelope
    attempt: int
    state: State = State.PENDING
    ctx: ExecContext | None = None
    lost: bool = False
    abandoned: bool = False
    args: dict[str, Any] | None = None  # the effective args (after tool_request middleware)
    sensitive: tuple[str, ...] = ()
    middleware_trace: list[dict[str, Any]] = field(default_factory=list)  # request middleware's, for audit
    started: float = field(default_factory=time.monotonic)
    trace: NoTrace = NO_TRACE
    claimed_at: float = 0.0  # wall clock when this worker began it (0: never began)
    outcome: str = ""  # how it ended here (its terminal state, retrying, handed_back, lost); "" while running
    rate: bool = False  # its concurrency key has a rate limit (its sends are stamped on the limiter)
    sent: bool = False  # a request of it left: its limiter entry counts it
    ran: bool = False  # its executor or provider was called (a refused call's duration is not a run's)
    usage: dict[str, int] | None = None  # an LLM call's reported tokens: {"in": prompt, "out": completion}
    api_request: dict[str, Any] | None = None  # an LLM call's answering request: api_request_id, provider, model, api_mode
    request: dict[str, Any] | None = None  # an LLM call's provider kwargs as built (its model filled in)
    notices: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # hooks' events, for the runner
    span: Any = None  # the executor span while the executor runs (``CallSpans``)
    breaker: Any = None  # (its breaker config, probe) while the executor runs (``Circuit``)
    open: _Write | None = None  # its last write, while later moves may still join it
    # Guards joining that write against the sender taking it; one per call, so calls never wait on each other.
    writes: threading.Lock = field(default_factory=threading.Lock)
    passed_on: bool = False  # its end takes the next call, which gets its thread slot (``CallRunner.next_call``)
    take_sent: Sequence[Any] = ()  # the ``take`` arguments its ending write last went with
    holds: bool = False  # it counts in ``WorkerCore.held`` (from track() to release() or untrack())

    @property
    def queue_wait(self) -> float:
        """Seconds from its submission to this worker beginning it."""
        return max(0.0, self.claimed_at - float(self.env.submitted_at))


class _Write:
    """A call's moves queued as one outbox write (one script call): moves made before the sender takes it join
    it, and their events are still recorded and published one by one, in order, with their own times."""

    __slots__ = ("run", "calls", "current", "steps", "kw", "after", "callbacks", "taken")

    def __init__(self, run: Running, calls: Calls, current: State) -> None:
        self.run = run
        self.calls = calls
        self.current = current  # the state before the first move
        self.steps: list[Step] = []
        self.kw: dict[str, Any] = {}  # the last move's options (a terminal one's fields, ttl, hand-off)
        self.after: list[Writer] = []  # more writes in the same pipeline (the hooks': audit record, failures)
        self.callbacks: list[Callable[[Any], None]] = []
        self.taken = False  # the sender has read it: later moves make a write of their own

    def send(self, pipe: Any) -> None:
        """The outbox's writer: the moves so far as one ``Calls.move``, then the writes riding with them."""
        run = self.run
        with run.writes:
            self.taken = True
            steps, kw, after = list(self.steps), self.kw, list(self.after)
        target, detail, ts = steps[-1]
        if callable(kw.get("take")):  # (its lease deadline from when it goes out, every time it does)
            run.take_sent = kw["take"]()
            kw = {**kw, "take": run.take_sent}
        self.calls.move(
            run.info, target, attempt=run.attempt, current=self.current, detail=detail, via=steps[:-1], ts=ts,
            pipeline=pipe, **kw,
        )
        for more in after:  # (one that fails alone: the move itself still goes)
            try:
                more(pipe)
            except Exception:  # noqa: BLE001 - e.g. a hook's record the wire cannot carry
                log.exception("a write riding with a move could not be built", call_id=run.info.call_id)

    def replied(self, reply: Any) -> None:
        if (  # a resend (its first reply lost) of a write that ran: the call is where this write put it
            not isinstance(reply, Exception) and int(reply[0]) == WRONG_STATE
            and text(reply[1]) == str(self.steps[-1][0])
        ):
            reply = [0, reply[1]]  # (fenced by attempt: at this attempt only this worker moves the call)
        for check in self.callbacks:  # complete: the sender took the write before this reply
            try:
                check(reply)
            except Exception:  # noqa: BLE001 - each move's callback runs (the last returns a hand-off)
                log.exception("transition callback failed", call_id=self.run.info.call_id)


class Failures(Hook):
    """The worker's call counts (its heartbeat reports them) and the fleet's list of recent failures
    (``hermes:failures``), written with the failed call's terminal move."""

    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        core = self.core
        core.processed += 1
        if state != "failed":
            return None
        core.failed += 1
        principal = run.env.context.get("principal") if run.env is not None else None
        entry = failure_entry(run.info, error or {}, core.name, principal)
        return lambda pipe: push_failure(pipe, entry)


# The per-call concerns (``workers/hooks.py``): ``before_*`` run in this order, ``after_*`` in reverse. The
# breaker is checked before the executor span opens (an open circuit calls no executor).
HOOKS: list[type[Hook]] = [CallMetrics, CallLog, Circuit, CallSpans, Checks, Usage, AuditRecordHook, Failures]


Stage = list[tuple[Callable[..., None] | None, Callable[..., None] | None]]


class CallRunner:
    """Runs claimed calls for one worker process: owns every state move of a call and runs its hooks."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        # Set by the worker: the TRANSITION ``take`` arguments for the call ending (None: take none), and
        # what gets the reply. Without them each ending call's thread slot goes back at once.
        self.next_call: Callable[[Running], Callable[[], Sequence[Any]] | None] | None = None
        self.took: Callable[[str, Any, Sequence[Any]], None] | None = None
        hooks = [cls(core) for cls in HOOKS]
        self._starts = [f for h in hooks if (f := hooked(h, "before_call"))]
        self._ends = [f for h in reversed(hooks) if (f := hooked(h, "after_call"))]
        self._endings = [f for h in hooks if (f := hooked(h, "ending"))]
        self._stages: dict[str, Stage] = {}
        for stage in ("flow", "checks", "chain", "execute"):
            pairs = [(hooked(h, f"before_{stage}"), hooked(h, f"after_{stage}")) for h in hooks]
            self._stages[stage] = [pair for pair in pairs if pair != (None, None)]

    def _stage(self, stage: str, run: Running, spec: ToolSpec, args: dict[str, Any], body: Callable[[], Any]) -> Any:
        """``body`` between the stage's ``before_*`` (table order; one raising ends the stage) and ``after_*``
        (reverse order, for the hooks whose ``before_*`` returned; contained), then the hooks' notices."""
        pairs = self._stages[stage]
        done, error = 0, None
        try:
            for before, _ in pairs:
                if before is not None:
                    before(run, spec, args)
                done += 1
            return body()
        except BaseException as e:
            error = e
            raise
        finally:
            for _, after in reversed(pairs[:done]):
                if after is None:
                    continue
                try:
                    after(run, spec, args, error)
                except Exception:  # noqa: BLE001 - a hook's failure does not change the call's outcome
                    log.exception("hook failed", stage=f"after_{stage}", hook=type(getattr(after, "__self__", after)).__name__)
            if run.notices:
                notices, run.notices = run.notices, []
                for event_type, detail in notices:
                    self.publish(run, event_type, detail)

    def _ended(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None:
        run.outcome = outcome
        for after in self._ends:
            try:
                after(run, outcome, error, duration)
            except Exception:  # noqa: BLE001 - as in _stage
                log.exception("hook failed", stage="after_call", hook=type(getattr(after, "__self__", after)).__name__)

    def _move(self, run: Running, target: State, detail: dict[str, Any] | None = None) -> None:
        current = run.state
        run.state = target
        if target is State.EXECUTING and run.rate and run.env.kind == "tool":
            run.sent = True  # (its limiter entry counts from the call's end, when the back end surely had it)
        self._write(run, current, (target, detail, time.time()), {}, check=lambda reply: self._check(run, target, reply))

    def _write(
        self,
        run: Running,
        current: State,
        step: Step,
        kw: dict[str, Any],
        *,
        check: Callable[[Any], None],
        after: Sequence[Writer] = (),
        last: bool = False,
    ) -> None:
        """Queue a move: joined to the call's open write when the sender has not taken it yet."""
        with run.writes:
            w = run.open
            if w is None or w.taken:
                w = _Write(run, self.core.calls, current)
                self.core.write(run, w.send, w.replied)
            w.steps.append(step)
            w.kw = kw
            w.after.extend(after)
            w.callbacks.append(check)
            run.open = None if last else w

    @staticmethod
    def seal(run: Running) -> None:
        """Later moves of ``run`` make a new write (a write other than a move was queued after its last)."""
        with run.writes:
            run.open = None

    def _check(self, run: Running, target: State, reply: Any) -> None:
        if isinstance(reply, Exception):
            log.error("transition not written", call_id=run.info.call_id, state=str(target), error=str(reply))
            return
        if int(reply[0]) < 0 and not run.lost:
            run.lost = True
            if run.ctx is not None:
                run.ctx.cancelled.set()
            log.info(
                "call taken from this worker",
                call_id=run.info.call_id,
                wanted=str(target),
                actual=reply[1].decode() if isinstance(reply[1], bytes) else reply[1],
            )

    def executing(self, run: Running) -> None:
        """The call reached its execution chain (or a middleware answered for it): ``routing`` → ``executing``."""
        if run.state is State.ROUTING:
            self._move(run, State.EXECUTING)

    def execution(self, run: Running, spec: ToolSpec | None, payload: dict[str, Any], chain: Callable[[], Any]) -> Any:
        """DESIGN.md's executing step: the move, then (a tool call) the chain stage — the breaker's check
        first — around the execution middleware chain; formatting as it returns, before the post hooks."""
        self.executing(run)
        result = chain() if spec is None else self._stage("chain", run, spec, payload, chain)
        if not (run.lost or run.abandoned):
            self.formatting(run)
        return result

    def formatting(self, run: Running) -> None:
        """Its execution chain returned (or a hook answered for it): on to ``formatting``, once."""
        if run.state is not State.FORMATTING:
            self.executing(run)
            self._move(run, State.FORMATTING)

    def publish(self, run: Running, event_type: str, detail: dict[str, Any]) -> None:
        """A non-state event (progress, a stream delta), fenced like a transition."""
        calls = self.core.calls
        state = run.state
        ts = time.time()

        def write(pipe: Any) -> None:
            calls.note(run.info, event_type, detail, attempt=run.attempt, current=state, ts=ts, pipeline=pipe)

        with run.writes:  # after the call's moves so far, before its next ones
            run.open = None
            self.core.write(run, write, lambda reply: self._check(run, state, reply))

    def run(self, claimed: Claimed) -> bool:
        """Run one claimed call to a terminal state (or hand it back); never raises. True when its thread
        slot passed on with its end (``next_call``: the worker must not give it back)."""
        try:
            env = envelope_of(claimed.data)
            if env.call_id != claimed.call_id:  # its moves would be another call's: ending it, or none
                raise DecodeError(f"the payload of call {claimed.call_id} names another call, {env.call_id}")
        except DecodeError as e:  # (its end may take the next call onto this thread slot, as any end)
            return self._fail_undecodable(claimed, e)
        ckey = concurrency_key(env)
        claimed_at = time.time()
        # With tracing on, events carry the consumer span's id, so events and spans line up.
        trace = CallTrace.start(env, claimed.attempt, claimed_at)
        info = CallInfo.of(env, ckey, span_id=trace.span_id or new_span_id())
        run = Running(info, env, claimed.attempt, trace=trace, claimed_at=claimed_at)
        self.core.track(run)
        structlog.contextvars.bind_contextvars(
            call_id=env.call_id, trace_id=info.trace_id, span_id=info.span_id, tool=info.name
        )
        try:
            for start in self._starts:
                start(run)
            self._run(run)
        except CallCancelled as e:
            if not run.abandoned and not run.lost:
                self._finish(run, State.CANCELLED, error=e.to_wire())
        except RateLimited as e:
            if not run.abandoned and not run.lost:
                self._back_to_waiting(run, e)
        except HermesError as e:
            if not run.abandoned and not run.lost and not self._paused(run, e) and not self._retry(run, e):
                self._finish(run, State.FAILED, error=e.to_wire())
        except Exception as e:  # noqa: BLE001 - nothing a caller sends may kill the worker
            log.exception("call crashed in the worker")
            if not run.abandoned and not run.lost:
                self._finish(
                    run, State.FAILED, error={"type": "internal_error", "message": f"{type(e).__name__}: {e}"}
                )
        finally:
            self.core.untrack(run)
            if run.ctx is not None:  # (its sink closes over the call: a reference cycle per call otherwise)
                run.ctx.progress_sink = None
            if not run.outcome:  # retrying, handed back or taken over: no terminal move here
                if run.state is State.RETRYING:
                    outcome = "retrying"
                else:
                    outcome = "handed_back" if run.abandoned else "lost"
                self._ended(run, outcome, None, time.monotonic() - run.started)
            trace.finish()
            structlog.contextvars.clear_contextvars()
        return run.passed_on

    def _run(self, run: Running) -> None:
        env, core = run.env, self.core
        self._move(run, State.ROUTING, {"worker": core.name})
        if env.kind == "llm":
            result = LLMCall(core, run, self).execute()
            if run.lost or run.abandoned:
                return
            self.formatting(run)
            self._finish(run, State.DONE, result=result)
            return
        spec = core.directory.get(env.tool or "", env.tool_version).spec
        run.rate = bool(spec.config.get("rate_limit"))
        run.sensitive = spec.sensitive
        run.ctx = ExecContext(
            call_id=env.call_id,
            tool_name=spec.name,
            timeout=float(env.options.timeout or spec.timeout),
            attempt=run.attempt,
            traceparent=env.traceparent,
            tracestate=env.tracestate,
            baggage=env.baggage,
            progress_sink=lambda msg: self.publish(run, PROGRESS, {"message": msg}),
            settings=core.settings.executor_settings(spec.executor),
        )
        if core.is_cancelled(env.call_id):
            run.ctx.cancelled.set()
        args = coerce_args(spec.input_schema, dict(env.args or {}))
        result = self._stage("flow", run, spec, args, lambda: self._flow(run, spec, args))
        if run.lost or run.abandoned:
            return
        self.formatting(run)  # (already, unless a pre_tool_call block answered without executing)
        check_output(spec.output_schema, result, spec.name)
        self._finish(run, State.DONE, result=result)

    def _flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> Any:
        """The contract's tool call (``middleware/call_order.py``): the check hooks as its policy step, the
        executor between the execute hooks; executing before the tool_execution chain, formatting after it."""
        ctx = run.ctx
        assert ctx is not None

        def checks(_tool: str, eff: dict[str, Any], _ctx: dict[str, Any]) -> None:
            self._stage("checks", run, spec, eff, _nothing)

        def execute(eff: dict[str, Any]) -> Any:
            ctx.check()
            run.ran = True
            executor = get_executor(spec.executor, ctx.settings)
            body = lambda: _secrets_kept(run_executor, executor, spec, eff, ctx, run.sensitive)  # noqa: E731
            return self._stage("execute", run, spec, eff, body)

        def on_trace(trace: list[dict[str, Any]]) -> None:
            run.middleware_trace = trace

        context = run.env.context
        return self.core.tool_flow.run(
            spec.name,
            args,
            execute=execute,
            context={k: context[k] for k in TOOL_CONTEXT if context.get(k) is not None},
            policy=checks,
            on_trace=on_trace,
            skip_plugins=plugins_applied(context),
            around_execution=lambda eff, chain: self.execution(run, spec, eff, chain),
        )

    def _back_to_waiting(self, run: Running, limited: RateLimited) -> None:
        """The provider refused for its rate and the key is paused: the call goes back to the head of its
        key's waiting calls (not a counted attempt), to be promoted when the pause ends."""
        self.seal(run)
        calls, info, attempt, current = self.core.calls, run.info, run.attempt, run.state
        run.state = State.RETRYING
        detail = {"reason": "rate_limited", "paused_until": limited.until, "next_attempt": attempt + 1}

        def write(pipe: Any) -> None:
            calls.retry(info, attempt=attempt, current=current, detail=detail, pipeline=pipe)
            pipe.hincrby(keys.job(info.call_id), keys.F_MAX_ATTEMPTS, 1)
            calls.requeue(info, attempt=attempt + 1, first=True, pipeline=pipe)

        self.core.outbox_of(run).put(write, lambda reply: self._check(run, State.RETRYING, reply))
        log.info("provider rate limit: call back to waiting", paused_until=limited.until)

    def _paused(self, run: Running, error: HermesError) -> bool:
        """A rate-limited tool's back end refused for its rate (429/503): as for a provider's, the key (every
        partition) is paused for the fleet as long as it asked, at most the spec's ``retry.max_backoff``, and
        the call goes back to waiting (at most RATE_RETURNS times)."""
        status, env, info = error.details.get("status"), run.env, run.info
        if not run.rate or env.kind != "tool" or status not in PAUSE_STATUSES or run.attempt > RATE_RETURNS:
            return False
        try:
            spec = self.core.directory.get(env.tool or "", env.tool_version).spec
        except HermesError:  # (removed meanwhile)
            return False
        wait = min(float(error.details.get("retry_after") or DEFAULT_PAUSE), retry.RetryPolicy.of(spec.retry).max_backoff)
        try:  # (a Redis refusing the pause, at maxmemory or away: the call ends as any failed one, not here)
            for q in keys.partition_names(keys.base_queue(info.queue), keys.partition_count(spec)):
                until = self.core.limiter.pause(info.call_id, q, info.ckey, wait)
        except redis.RedisError as e:
            log.warning("pausing the rate-limited tool failed", error=str(e))
            return False
        self._back_to_waiting(run, RateLimited(until))
        return True

    def _retry(self, run: Running, error: HermesError) -> bool:
        """Schedule another attempt when the tool's ``retry:`` allows it (the slot goes back meanwhile)."""
        planned = retry.plan(self.core, run, error)
        if planned is None:
            return False
        self.seal(run)
        delay, allowed = planned
        due = time.time() + delay
        detail = {
            "reason": "error",
            "error": error.to_wire(),
            "next_attempt": run.attempt + 1,
            "next_attempt_at": due,
            "delay": round(delay, 3),
            "max_attempts": allowed,  # (the caller's max_attempts may be fewer than the spec's retries allow)
        }
        calls, current = self.core.calls, run.state
        run.state = State.RETRYING

        def write(pipe: Any) -> None:
            calls.retry(run.info, attempt=run.attempt, current=current, detail=detail, due=due, pipeline=pipe)

        self.core.write(run, write, lambda reply: self._check(run, State.RETRYING, reply))
        self.core.scheduler.kick(due)
        run.trace.retry(run.attempt, delay, error)  # a span event on this attempt's process span
        log.info("attempt failed, retrying", attempt=run.attempt, error=error.type, delay=round(delay, 3))
        return True

    def _finish(
        self, run: Running, target: State, *, result: Any = None, error: dict[str, Any] | None = None
    ) -> None:
        duration = time.monotonic() - run.started
        fields: dict[str, Any] = {}
        detail: dict[str, Any] = {"duration_ms": round(duration * 1000, 3)}
        if run.api_request is not None and target is State.DONE:
            detail["api_request"] = run.api_request
        if target is State.DONE:
            try:
                packed = pack(result)
            except (TypeError, ValueError) as e:
                target = State.FAILED
                what = "tool result" if run.env is None or run.env.kind == "tool" else "LLM response"
                error = {"type": "unserializable_result", "message": f"{what} cannot be encoded: {e}"}
            else:  # stored once: in the done event (history and caller), else in the record when large
                if len(packed) <= INLINE_RESULT_LIMIT:
                    detail["result"] = result
                elif (cap := self._result_cap(run)) is not None and len(packed) > cap:
                    target, result = State.FAILED, None
                    error = OutputTooLarge(
                        f"tool {run.info.name!r}: its result of {len(packed)} bytes passes the cap of {cap} "
                        "(max_output)", limit=cap,
                    ).to_wire()
                else:
                    fields[keys.F_RESULT] = packed
                    detail["result_in_record"] = True
        if error is not None:  # (in the terminal event only: the ended record reads it there)
            args = run.args if run.args is not None else getattr(run.env, "args", None)  # (no env: undecodable)
            secrets = logs.secret_values(args or {}, run.sensitive)
            if secrets:  # (a check's message may quote a secret argument too, not only a back end's)
                error = logs.scrub_all(error, secrets)
            detail["error"] = error
        outcome = str(target)
        writers = [w for ending in self._endings if (w := ending(run, outcome, result, error, duration)) is not None]
        current = run.state
        run.state = target

        kw: dict[str, Any] = {"fields": fields, "ttl": self.core.settings.workers.result_ttl}
        if run.rate:
            kw["sent"] = run.sent
            if run.usage is not None:
                kw["used_tokens"] = run.usage["in"] + run.usage["out"]
        take = self.next_call(run) if self.next_call is not None and self.took is not None else None
        took = self.took if take else None
        if take:
            kw["take"], run.passed_on = take, True
        # Its key's slot here ends before the write can be answered: the call the write takes may begin and end
        # on another thread before this one reaches untrack(), and its own take must not count this call.
        self.core.release(run)

        def check(reply: Any) -> None:
            try:
                self._check(run, target, reply)
            finally:
                if took is not None:  # (the calls it took start on its thread slot, else the slot goes back)
                    took(run.info.queue, reply, run.take_sent)

        self._write(run, current, (target, detail, time.time()), kw, check=check, after=writers, last=True)
        self._ended(run, outcome, error, duration)

    def _result_cap(self, run: Running) -> int | None:
        """The most bytes a tool call's result may take (its spec's ``max_output``, else its executor's,
        else ``DEFAULT_MAX_OUTPUT``: the formatting step's cap, whatever the executor); None for an LLM call."""
        env = run.env
        if env.kind != "tool":
            return None
        spec = self.core.directory.get(env.tool or "", env.tool_version).spec
        settings = self.core.settings.executor_settings(spec.executor)
        return int(spec.config.get("max_output") or settings.get("max_output") or DEFAULT_MAX_OUTPUT)

    def _fail_undecodable(self, claimed: Claimed, err: DecodeError) -> bool:
        """A payload that does not decode fails that call with a typed error; the worker goes on. True when
        its thread slot passed on with its end (as ``run``)."""
        core = self.core
        raw = core.conn.hmget(
            keys.job(claimed.call_id), keys.F_CHANNEL, keys.F_CKEY, keys.F_TRACE, keys.F_KIND, keys.F_TOOL, "origin"
        )
        chan, ckey, trace, kind, tool, origin = (text(v) for v in raw)
        info = CallInfo(
            claimed.call_id, trace, new_span_id(), kind or "tool", tool, session_id=None,
            channel=chan or keys.caller_channel("unknown"), ckey=ckey,
            queue=origin or keys.tag_in(claimed.call_id)[1:-1],  # its lease and slot are in its queue's keys
        )
        run = Running(info, None, claimed.attempt)  # type: ignore[arg-type]
        log.warning("undecodable call payload", call_id=claimed.call_id, error=str(err))
        self._finish(run, State.FAILED, error=err.to_wire())
        return run.passed_on


def _secrets_kept(run: Callable[..., Any], executor: Any, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext,
                  sensitive: Sequence[str]) -> Any:
    """``run(executor, spec, args, ctx)``; its error's message and text details show no value of a sensitive
    or secret-named argument (a back end's error may quote it: `ls: cannot access 'hunter2'`), before the
    span, the log line, the audit record or the caller see it."""
    try:
        return run(executor, spec, args, ctx)
    except HermesError as e:
        secrets = logs.secret_values(args, sensitive)
        if secrets:
            e.message = logs.scrub(e.message, secrets)
            e.args = (e.message,)
            e.details = logs.scrub_all(e.details, secrets)
        raise


def _nothing() -> None:
    return None


def _blocked(tool_name: str, message: str, _ctx: dict[str, Any]) -> Any:
    raise CallFailed(
        message or f"tool {tool_name!r} was blocked by a plugin", error_type="blocked", tool=tool_name
    )


class WorkerCore:
    """Shared services of one worker process."""

    def __init__(self, conn: redis.Redis, settings: Settings, name: str) -> None:
        self.conn = conn
        self.settings = settings
        self.name = name
        pipes.configure(settings.broker.fast_path)
        self.calls = Calls(conn)
        self.calls.keep_history = settings.workers.keep_history
        self.confirmer = Confirmer(settings)  # WAITs for the replicas, when broker.wait_replicas asks
        self.outbox = Outbox(conn, confirmer=self.confirmer)
        # Batch calls' writes go through an outbox of their own (``outbox_of``): an agent's call never waits
        # behind a batch's round trip.
        self._batch_outbox: Outbox | None = None
        self.directory = Directory(conn)
        self._inflight: dict[str, Running] = {}
        # Calls that ended here whose writes are still in the outbox (a cluster slot moving): their leases are
        # kept, so the reaper does not run them again.
        self._unwritten: dict[str, Running] = {}
        self._writing: dict[int, int] = {}  # writes queued and not answered yet, per run (id of its Running)
        self._held: dict[str, int] = {}  # calls in flight here per concurrency key
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self.processed = 0
        self.failed = 0
        self.idle = threading.Condition(self._lock)
        # config.yaml's policy until one is pushed to Redis (``hermes-gateway policy push``).
        self._config_policy = Policy.from_settings(settings.policy)
        self.policy = self._config_policy
        self.policy_version = 0
        self.refresh_policy()
        self.audit = AuditLog.from_settings(conn, settings.audit)
        self.scheduler = RetryScheduler(conn, hold=settings.workers.lease)  # run on a thread by the Worker
        self.limiter = RateLimiter(conn)
        # Plugins log through stdlib logging (they run inside Hermes too); the root logger is held at
        # WARNING to quiet libraries, so plugin loggers get the gateway's own level.
        logging.getLogger(PLUGIN_NAMESPACE).setLevel(settings.logging.level)
        self.plugins = PluginManager(settings.home, discovery=settings.plugin_discovery)
        self.plugins.load()
        self.tool_flow = ToolCallFlow(self.plugins, on_blocked=_blocked)
        self.llm_flow = LLMCallFlow(self.plugins, describe_response=describe_response)
        otelsdk.setup("hermes-worker", settings.telemetry)
        telemetry.watch_queues(conn)
        self.stats = telemetry.StatsFlusher(conn, name, self.inflight_by_key)

    def track(self, run: Running) -> None:
        with self._lock:
            self._inflight[run.info.call_id] = run
            ckey = run.info.ckey
            self._held[ckey] = self._held.get(ckey, 0) + 1
            run.holds = True

    def write(self, run: Running, writer: Callable[[Any], None], callback: Callable[[Any], None]) -> None:
        """Queue a write of ``run``; until it is answered a call no longer in flight here is ``unwritten``."""
        key = id(run)
        with self._lock:
            self._writing[key] = self._writing.get(key, 0) + 1

        def answered(reply: Any) -> None:
            with self._lock:
                left = self._writing.pop(key, 1) - 1
                if left > 0:
                    self._writing[key] = left
                elif self._unwritten.get(run.info.call_id) is run:
                    del self._unwritten[run.info.call_id]
            callback(reply)

        self.outbox_of(run).put(writer, answered)

    def outbox_of(self, run: Running) -> Outbox:
        """The outbox of ``run``'s writes: the batch one for a batch call (not for an undecodable one)."""
        if run.env is None or run.env.options.call_class != "batch":
            return self.outbox
        if self._batch_outbox is None:  # (the lock only until it exists: every batch write asks)
            with self._lock:
                if self._batch_outbox is None:
                    self._batch_outbox = Outbox(self.conn, confirmer=self.confirmer, name="hermes-outbox-batch")
        return self._batch_outbox

    def flush(self, timeout: float) -> None:
        """Wait until every write queued so far has been sent (both outboxes)."""
        for outbox in (self.outbox, self._batch_outbox):
            if outbox is not None:
                outbox.flush(timeout)

    def unwritten(self) -> list[Running]:
        """Calls no longer running here whose last writes are not in Redis yet (their leases are kept)."""
        with self._lock:
            return list(self._unwritten.values())

    def untrack(self, run: Running) -> None:
        with self._lock:
            if self._inflight.get(run.info.call_id) is run:
                del self._inflight[run.info.call_id]
            if self._writing.get(id(run)):
                self._unwritten[run.info.call_id] = run
            # Paired with track(), even when a newer run of the same call id replaced this one in _inflight.
            self._unhold(run)
            self._cancelled.discard(run.info.call_id)
            self.idle.notify_all()

    def release(self, run: Running) -> None:
        """``run`` no longer counts in ``held`` (its terminal write is being queued); untrack() then leaves it."""
        with self._lock:
            self._unhold(run)

    def _unhold(self, run: Running) -> None:
        if not run.holds:  # (never tracked, or released already)
            return
        run.holds = False
        ckey = run.info.ckey
        left = self._held.get(ckey, 1) - 1
        if left > 0:
            self._held[ckey] = left
        else:
            self._held.pop(ckey, None)

    def held(self, ckey: str) -> int:
        """Calls of concurrency key ``ckey`` in flight in this process (each holds one of its slots)."""
        return self._held.get(ckey, 0)

    def inflight_by_key(self) -> dict[str, int]:
        """Calls running in this process per concurrency key."""
        return Counter(run.info.ckey for run in self.inflight())

    def rate_sent(self, run: Running) -> None:
        """The provider answered ``run``'s request: stamp its rate limiter entry (a late stamp only keeps the
        entry counted longer)."""
        info, limiter = run.info, self.limiter
        self.outbox.put(lambda pipe: limiter.sent(info.call_id, info.queue, info.ckey, pipeline=pipe))

    def check_budget(self, principal: str | None) -> None:
        """Raise BudgetExceeded when ``principal`` has used its ``daily_tokens`` today (UTC)."""
        budget = self.policy.daily_tokens(principal) if principal else None
        if budget is None:
            return
        used = int(self.conn.get(keys.usage_day(time.strftime("%Y-%m-%d", time.gmtime()), str(principal))) or 0)
        if used >= budget:
            raise BudgetExceeded(
                f"principal {principal!r} has used {used} of its {budget} tokens today (UTC)",
                principal=principal, used=used, budget=budget,
            )

    def inflight(self) -> list[Running]:
        with self._lock:
            return list(self._inflight.values())

    def inflight_count(self) -> int:
        return len(self._inflight)

    def cancel(self, call_id: str) -> bool:
        """Cancel a call running here (control message); True when it was ours."""
        with self._lock:
            run = self._inflight.get(call_id)
            self._cancelled.add(call_id)
            if len(self._cancelled) > 10_000:  # ids of calls that never came here
                self._cancelled.clear()
            if run is None:
                return False
        if run.ctx is not None:
            run.ctx.cancelled.set()
        return True

    def is_cancelled(self, call_id: str) -> bool:
        return call_id in self._cancelled

    def reload(self) -> None:
        """Re-import plugins and re-read policy (``hermes-gateway plugins reload``)."""
        self.plugins.reload()
        self._config_policy = Policy.from_settings(load_settings(self.settings.home).policy)
        self.refresh_policy()

    def refresh_policy(self) -> bool:
        """Re-read the active policy (a push notice, a reconnect); True when it changed."""
        try:
            policy, version = policy_store.active(self.conn, self._config_policy)
        except DecodeError as e:
            # A broken push must not open everything up: keep judging by the policy we have.
            log.error("stored policy ignored; keeping the current one", error=str(e))
            return False
        changed = policy != self.policy
        self.policy, self.policy_version = policy, version  # the next call reads the new one
        if changed:
            log.info("policy changed", version=version, mode=policy.mode, digest=policy.digest())
        return changed

    def close(self) -> None:
        if self._batch_outbox is not None:
            self._batch_outbox.close()
        self.outbox.close()
        self.stats.close()
