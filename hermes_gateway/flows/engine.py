"""Running a flow: every step is an ordinary call through ``Gateway.call_tool`` (limits, breakers,
policy and audit apply to each); the runner only decides what to call next and reports as it goes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker import events as ev_mod
from broker.breaker import Breakers, breaker_config, rejecting
from broker.errors import CallTimeout, CircuitOpen, FlowError, HermesError
from hermes_gateway.handle import cancel_unended

from .expr import render
from .model import Flow, Step

if TYPE_CHECKING:
    from hermes_gateway.client import Gateway

OK_STATES = ("done", "skipped", "fallback")


@dataclass
class StepResult:
    """What became of one step; expressions read it as ``steps.<id>.result`` / ``.state`` / ``.error``."""

    id: str
    state: str = "pending"  # pending, running, done, failed, skipped, fallback, partial
    result: Any = None
    error: dict[str, Any] | None = None
    call_id: str | None = None
    items: list[dict[str, Any]] | None = None
    reason: str = ""

    def view(self) -> dict[str, Any]:
        return {
            "state": self.state, "ok": self.state in OK_STATES, "result": self.result, "error": self.error,
            "call_id": self.call_id, "items": self.items, "reason": self.reason,
        }


@dataclass(frozen=True)
class StepEvent:
    """A step changed state (or its call did): what ``flow run`` prints live."""

    step: str
    state: str
    call_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)


@dataclass
class FlowResult:
    """The flow's outcome: ``done`` or ``failed``, every step's result, and the flow's ``result``."""

    name: str
    state: str
    steps: dict[str, StepResult]
    result: Any = None
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "state": self.state, "result": self.result, "error": self.error,
            "steps": {k: v.view() for k, v in self.steps.items()},
        }


class FlowRunner:
    """Runs flows on a Gateway; ``on_event`` hears every step and call state change."""

    def __init__(
        self, gateway: Gateway, *, on_event: Callable[[StepEvent], None] | None = None,
        wait: float | None = 300.0, max_parallel: int = 64, **context: Any,
    ) -> None:
        self.gw = gateway
        self.on_event = on_event
        self.wait = wait
        self.max_parallel = max_parallel
        self.context = context
        self._breakers = Breakers(gateway.conn)
        self._calls: list[Any] = []  # the run's calls (cancelled if the run is interrupted)
        self._calls_lock = threading.Lock()
        self._stopped = False  # cancel_running() ran: a call a branch has yet to make is not made

    def track(self, *handles: Any) -> None:
        with self._calls_lock:
            self._calls.extend(handles)
            stopped = self._stopped
        if stopped:  # (made by a branch thread as the run was being stopped: it goes too)
            self.cancel_running()

    def cancel_running(self) -> int:
        """Cancel the run's calls that have not ended (Ctrl-C on ``flow run``), and make no more; how many
        were cancelled."""
        with self._calls_lock:
            calls, self._calls, self._stopped = self._calls, [], True
        return cancel_unended(calls)

    def check_running(self) -> None:
        """FlowError once the run was stopped (a parallel branch must not start a call after Ctrl-C)."""
        if self._stopped:
            raise FlowError("the flow was interrupted: its calls were cancelled")

    def run(self, flow: Flow, args: dict[str, Any] | None = None) -> FlowResult:
        """Run every step in order; stops at the first failed step whose ``on_error`` is ``fail``. A flow that
        does not validate, or names a tool not in the directory, raises before any call."""
        flow.validate()
        flow.check_tools({e.spec.name for e in self.gw.tools()})
        results = {s.id: StepResult(s.id) for s in flow.all_steps()}
        scope: dict[str, Any] = {"args": dict(args or {}), "steps": {k: v.view() for k, v in results.items()}}
        self._stopped = False
        run = _Run(self, results, scope)
        try:
            completed = run.steps(flow.steps)
        except KeyboardInterrupt:  # (Ctrl-C: the calls it was waiting on stop too)
            self.cancel_running()
            raise
        finally:
            with self._calls_lock:
                self._calls = []
        out = FlowResult(flow.name, "done" if completed else "failed", results)
        if not completed:  # (the step that stopped the flow: the innermost, in a group)
            failed = results[run.stopped_at or next(r.id for r in results.values() if r.state == "failed")]
            out.error = {"step": failed.id, **(failed.error or {})}
            return out
        try:
            each = {s.id: results[s.id].result for s in flow.steps}
            out.result = render(flow.result_tpl, scope) if flow.result is not None else each
        except FlowError as e:
            out.state, out.error = "failed", {"step": "result", **e.to_wire()}
        return out


class _Run:
    """One run of one flow."""

    def __init__(self, runner: FlowRunner, results: dict[str, StepResult], scope: dict[str, Any]) -> None:
        self.r = runner
        self.results = results
        self.scope = scope
        self.stopped_at: str | None = None  # the step that stopped the flow

    def emit(self, res: StepResult, state: str, **detail: Any) -> None:
        """Move the step to ``state``: the scope sees it, ``on_event`` hears it."""
        res.state = state
        self.scope["steps"][res.id] = res.view()
        if self.r.on_event is not None:
            self.r.on_event(StepEvent(res.id, res.state, res.call_id, detail))

    def steps(self, steps: list[Step]) -> bool:
        for s in steps:
            if not self.step(s):
                self.stopped_at = self.stopped_at or s.id  # (a group's inner step came first)
                return False
        return True

    def step(self, step: Step) -> bool:
        """Run one step; False when the flow must stop."""
        res = self.results[step.id]
        try:
            if step.when_expr is not None and not step.when_expr.evaluate(self.scope):
                res.reason = f"condition is false: {step.when}"
                self.emit(res, "skipped", reason=res.reason)
                return True
            if step.kind == "tool":
                self.tool(step, res)
            elif step.kind == "for_each":
                self.for_each(step, res)
            elif step.kind == "parallel":
                self.parallel(step, res)
            else:
                self.emit(res, "running")
                ok = self.steps(step.steps or [])
                res.result = {c.id: self.results[c.id].result for c in step.steps or []}
                if not ok:
                    res.error = {"type": "step_failed", "message": "a step of the group failed"}
                self.emit(res, "done" if ok else "failed")
        except HermesError as e:  # (an expression, or a fan-out's calls refused as a whole: bad arguments)
            res.error = e.to_wire()
            self.emit(res, "failed", error=res.error)
        if res.state == "failed" and step.on_error == "continue":
            self.stopped_at = None  # (an inner step of this group failed, and the flow goes on)
        return res.state != "failed" or step.on_error == "continue"

    # -- a tool call -----------------------------------------------------------------------------

    def tool(self, step: Step, res: StepResult) -> None:
        args = render(step.args_tpl, self.scope)
        if step.fallback is not None and self.breaker_open(step.tool or ""):
            self.fallback(step, res, args)
            return
        outcome = self.call(step.tool or "", args, step.timeout, res)
        if isinstance(outcome, CircuitOpen) and step.fallback is not None:
            self.fallback(step, res, args)
        else:
            self.settle(res, outcome, "done")

    def call(self, tool: str, args: Any, timeout: float | None, res: StepResult) -> Any:
        """One call, its events reported as they come; returns the result or the error. A call not ended
        within the runner's ``wait`` is cancelled (the step fails: its effects must not come later)."""
        handle = None
        deadline = _deadline(self.r.wait)
        try:
            self.r.check_running()
            handle = self.r.gw.call_tool(tool, args, timeout=timeout, **self.r.context)
            self.r.track(handle)
            res.call_id = handle.call_id
            self.emit(res, "running", tool=tool)
            for ev in handle.events(timeout=self.r.wait):
                if ev.type == ev_mod.TRANSITION and not ev.terminal:
                    self.emit(res, "running", call_state=ev.state, attempt=ev.attempt)
            return handle.result(0 if handle.done() else _left(deadline))
        except CallTimeout as e:
            cancel_unended([handle] if handle is not None else [])
            return e
        except HermesError as e:
            return e

    def settle(self, res: StepResult, outcome: Any, state: str, **detail: Any) -> None:
        """A call's outcome: its error fails the step, its result ends it in ``state``."""
        if isinstance(outcome, HermesError):
            res.error = outcome.to_wire()
            self.emit(res, "failed", error=res.error)
        else:
            res.result = outcome
            self.emit(res, state, **detail)

    def fallback(self, step: Step, res: StepResult, args: Any) -> None:
        """The tool's breaker is open: skip the step, or call the fallback tool."""
        fb = step.fallback
        assert fb is not None
        res.reason = "breaker open"
        if fb.skip:
            self.emit(res, "skipped", reason=res.reason)
            return
        fb_args = render(step.fallback_tpl, self.scope) if step.fallback_tpl is not None else args
        outcome = self.call(fb.tool or "", fb_args, step.timeout, res)
        self.settle(res, outcome, "fallback", tool=fb.tool, reason=res.reason)

    def breaker_open(self, tool: str) -> bool:
        """Whether the tool's breaker would refuse a call now (then the fallback goes first)."""
        try:
            cfg = breaker_config(self.r.gw.settings, self.r.gw.tool(tool).spec)
        except HermesError:
            return False
        return cfg is not None and rejecting(self.r._breakers.state(cfg.key), cfg.cooldown)

    # -- fan-out ---------------------------------------------------------------------------------

    def for_each(self, step: Step, res: StepResult) -> None:
        assert step.each_expr is not None
        items = step.each_expr.evaluate(self.scope)
        if not isinstance(items, list):
            raise FlowError(
                f"step {step.id}: for_each: {step.for_each!r} is a {type(items).__name__}, not a list"
            )
        fb = step.fallback
        if fb is not None and self.breaker_open(step.tool or ""):
            if fb.skip:
                self.fallback(step, res, None)
                return
            calls = [self.fallback_call(step, i, it) for i, it in enumerate(items)]
        else:
            calls = [
                (step.tool or "", render(step.args_tpl, {**self.scope, step.as_name: it, "index": i}))
                for i, it in enumerate(items)
            ]
        opts = {"timeout": step.timeout} if step.timeout is not None else {}
        self.r.check_running()
        batch = self.r.gw.submit_many(calls, **opts, **self.r.context) if calls else []
        self.r.track(*batch)
        self.emit(res, "running", total=len(calls))
        deadline = _deadline(self.r.wait)
        out: list[dict[str, Any]] = []
        for i, handle in enumerate(batch):
            try:
                result = handle.result(_left(deadline))
                out.append({"index": i, "ok": True, "result": result, "call_id": handle.call_id})
            except CircuitOpen as e:  # (the breaker opened while the items went out: this one degrades)
                out.append(self.fallback_item(step, i, items[i], e, handle.call_id, deadline))
            except HermesError as e:
                if isinstance(e, CallTimeout):
                    cancel_unended([handle])
                out.append({"index": i, "ok": False, "error": e.to_wire(), "call_id": handle.call_id})
            self.emit(res, "running", done=len(out), failed=sum(not o["ok"] for o in out), total=len(calls))
        self.combine(step, res, out, [o.get("result") for o in out])

    def fallback_call(self, step: Step, index: int, item: Any) -> tuple[str, Any]:
        """Item ``index``'s call to the step's fallback tool (its ``args`` rendered with the item in scope)."""
        assert step.fallback is not None
        scope = {**self.scope, step.as_name: item, "index": index}
        tpl = step.fallback_tpl if step.fallback_tpl is not None else step.args_tpl
        return step.fallback.tool or step.tool or "", render(tpl, scope)

    def fallback_item(
        self, step: Step, index: int, item: Any, error: CircuitOpen, call_id: str, deadline: float | None
    ) -> dict[str, Any]:
        """An item its tool's breaker refused: skipped, or its fallback tool's outcome (by the step's deadline:
        cancelled past it, as the items are); failed without one."""
        fb = step.fallback
        if fb is None:
            return {"index": index, "ok": False, "error": error.to_wire(), "call_id": call_id}
        if fb.skip:
            return {"index": index, "ok": True, "result": None, "skipped": "breaker open", "call_id": call_id}
        tool, args = self.fallback_call(step, index, item)
        handle = None
        try:
            self.r.check_running()
            handle = self.r.gw.call_tool(tool, args, timeout=step.timeout, **self.r.context)
            self.r.track(handle)
            result = handle.result(_left(deadline))
        except HermesError as e:
            if isinstance(e, CallTimeout) and handle is not None:
                cancel_unended([handle])
            return {"index": index, "ok": False, "error": e.to_wire(), "call_id": call_id, "fallback": tool}
        return {"index": index, "ok": True, "result": result, "call_id": handle.call_id, "fallback": tool}

    def parallel(self, step: Step, res: StepResult) -> None:
        branches = step.parallel or []
        self.emit(res, "running", branches=[b.id for b in branches])
        threads = min(len(branches), self.r.max_parallel)
        pool = ThreadPoolExecutor(threads, thread_name_prefix="hermes-flow")
        try:
            list(pool.map(self.step, branches))
        except BaseException:  # (Ctrl-C: the branches' calls stop now, not after they end)
            self.r.cancel_running()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        self.stopped_at = None  # (a branch's group that stopped: this step's outcome speaks for its branches)
        out = []
        for b in branches:
            r = self.results[b.id]
            item: dict[str, Any] = {"id": b.id, "ok": r.state in OK_STATES, "state": r.state}
            item.update({"result": r.result} if item["ok"] else {"error": r.error})
            out.append(item)
        self.combine(step, res, out, {b.id: self.results[b.id].result for b in branches})

    def combine(self, step: Step, res: StepResult, items: list[dict[str, Any]], result: Any) -> None:
        """A fan-out's outcome: ``done``, or with failures ``failed`` (``partial`` under ``on_error: continue``
        while some succeeded); its error names the first failure."""
        res.items, res.result = items, result
        bad = [i for i in items if not i["ok"]]
        if bad:
            first, err = bad[0].get("id", f"item {bad[0].get('index')}"), bad[0].get("error") or {}
            message = f"{len(bad)} of {len(items)} failed; first {first}: {err.get('type')}: {err.get('message')}"
            res.error = {"type": "partial_failure", "message": message, "failed": len(bad)}
        partial = step.on_error == "continue" and len(bad) < len(items)
        self.emit(res, "done" if not bad else ("partial" if partial else "failed"), failed=len(bad), total=len(items))


def _deadline(wait: float | None) -> float | None:
    """When a wait of ``wait`` seconds from now ends (None: it does not)."""
    return None if wait is None else time.monotonic() + wait


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline), never below 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
