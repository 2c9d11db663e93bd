"""Tools in, for /v1/chat/completions: the request's tools checked, put in the prompt and, for
tool_choice "required" or a named function, turned into a grammar the output must follow.

The format is Hermes' (Qwen2.5, and what SmolLM2-style ChatML models follow when told):
each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A chat
template that takes `tools` (Qwen2.5's, Hermes') renders them itself. For one that does not
(SmolLM2's, Gemma 3's), the tools and the instructions go in the system message, earlier
calls in the assistant's content and tool results in a user turn, as Qwen2.5's template
would write them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.server.errors import APIError
from tokenmill.structured_outputs import JSON_DEFAULTS, StructuredOutputsParams, closed_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
DEFAULT_SYSTEM = "You are a helpful assistant."


@dataclass
class ToolPlan:
    tools: list[dict]  # as sent, checked
    choice: str  # "auto", "none", "required" or "function"
    name: str | None  # the function tool_choice names
    parallel: bool

    @property
    def in_prompt(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def plan_tools(tools: list[dict] | None, tool_choice, parallel: bool) -> ToolPlan | None:
    """The checked tools and choice (None: the request has no tools)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, "each tool must be {'type': 'function', 'function': {...}}",
                           param=f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, "a function needs a name", param=f"tools.{i}.function.name")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, "parameters must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolPlan(tools, tool_choice or "auto", None, parallel)
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) \
        else None
    if name is None:
        raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                       param="tool_choice")
    return ToolPlan(tools, "function", name, parallel)


def template_takes_tools(template: str) -> bool:
    return "tools" in template


def prompt_messages(messages: list[dict], plan: ToolPlan | None, template: str) -> list[dict]:
    """Messages for a template that does not take tools: tools in the system message, calls
    and results as text. Unchanged for one that does (it gets tools= itself)."""
    if template_takes_tools(template):
        return [_for_template(m) for m in messages]
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps(_call(c), ensure_ascii=False)}\n{CLOSE}"
                              for c in m["tool_calls"])
            out.append({"role": m["role"], "content": "\n".join(filter(None, [m["content"],
                                                                                calls]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_results", None)
    if plan is not None and plan.in_prompt:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools)
        tools_text = INSTRUCTIONS.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tools_text}"}
        else:
            out.insert(0, {"role": "system", "content": f"{DEFAULT_SYSTEM}\n\n{tools_text}"})
    return out


def _call(call: dict) -> dict:
    """{"name", "arguments": {...}} of an OpenAI tool call (arguments arrive as JSON text)."""
    fn = call.get("function") or {}
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass  # shown as the text it is
    return {"name": fn.get("name"), "arguments": args}


def _for_template(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [{**c, "function": _call(c)} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


def constraint(plan: ToolPlan | None) -> StructuredOutputsParams | None:
    """For "required" or a named function: a grammar of one call (or, with
    parallel_tool_calls, one or more), each naming a tool and matching its parameters."""
    if plan is None or plan.choice not in ("required", "function"):
        return None
    fns = [t["function"] for t in plan.tools
           if plan.choice == "required" or t["function"]["name"] == plan.name]
    calls = [{"type": "object", "properties": {
        "name": {"const": fn["name"]},
        "arguments": fn.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"]} for fn in fns]
    schema = closed_objects(calls[0] if len(calls) == 1 else {"anyOf": calls})
    schema["x-guidance"] = JSON_DEFAULTS
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    rule = 'call ("\\n" call)*' if plan.parallel and plan.choice == "required" else "call"
    return StructuredOutputsParams(grammar=f"start: {rule}\ncall: {call}\n")
