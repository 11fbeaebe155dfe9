"""The ``Hook`` every per-call concern subclasses (``workers/hooks/__init__.py`` says how they run)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.toolspec import ToolSpec
    from workers.runner import Running, WorkerCore

Writer = Callable[[Any], None]  # more writes in the terminal move's pipeline


class Hook:
    """One per-call concern; override the stages it takes part in (the others are skipped)."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def before_call(self, run: Running) -> None: ...

    def after_call(self, run: Running, outcome: str, error: dict[str, Any] | None, duration: float) -> None: ...

    def before_flow(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_flow(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_checks(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def before_execute(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None: ...

    def after_execute(
        self, run: Running, spec: ToolSpec, args: dict[str, Any], error: BaseException | None
    ) -> None: ...

    def ending(
        self, run: Running, state: str, result: Any, error: dict[str, Any] | None, duration: float
    ) -> Writer | None:
        return None


def overrides(hook: Hook, name: str) -> bool:
    """Whether ``hook`` does something at ``name`` (the runner skips the no-op base methods)."""
    return getattr(type(hook), name) is not getattr(Hook, name)
