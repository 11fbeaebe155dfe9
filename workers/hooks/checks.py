"""The contract's policy step on the effective arguments: the active policy, then the tool's input schema."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workers.args import validate_args
from workers.hooks.hook import Hook

if TYPE_CHECKING:
    from broker.toolspec import ToolSpec
    from workers.runner import Running


class Checks(Hook):
    def before_checks(self, run: Running, spec: ToolSpec, args: dict[str, Any]) -> None:
        run.args = args  # the audit record keeps the arguments the checks saw, refused or not
        self.core.policy.enforce(run.env.context.get("principal"), spec, args)
        validate_args(spec.input_schema, args, spec.name)
