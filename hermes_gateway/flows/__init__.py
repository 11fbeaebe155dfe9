"""Orchestration of tool calls: flows of serial, parallel, conditional and fallback steps."""
