"""An episode with OpenAI tool calls: the model is offered a calculator, may call it (its
result comes back as a tool message), and is rewarded on its final answer, with a small bonus
for a call the calculator could evaluate.

Use it with (see calculator.yaml beside this file):

    rollout:
      workflow:
        kind: episode
        function: calculator:episode
        path: examples/episodes

The tool runs inside the rollout worker, as this function does; it needs no network. The
calls go through the worker's OpenAI-compatible API, which offers `tools` through the model's
chat template (in Hermes' <tool_call> layout where the template has none) and returns the
model's calls as OpenAI `tool_calls`.
"""

import ast
import json
import operator

from answers import is_right

TURNS = 2
TOOL_BONUS = 0.2
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression, e.g. 12 * (3 + 4).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


async def episode(client, row: dict) -> float:
    model = (await client.models.list()).data[0].id
    messages = [{"role": "user", "content": row["prompt"]}]
    used_tool = False
    for _ in range(TURNS):
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(is_right(message.content or "", row["answer"])) + (
                TOOL_BONUS if used_tool else 0.0)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = calculate(call.function.arguments)
            used_tool = used_tool or not result.startswith("error")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return TOOL_BONUS if used_tool else 0.0


def calculate(arguments: str) -> str:
    """The calculator tool: + - * / and parentheses over numbers, nothing else."""
    try:
        expression = json.loads(arguments)["expression"]
        return f"{_evaluate(ast.parse(str(expression), mode='eval').body):g}"
    except Exception as exc:  # the model's arguments are whatever it wrote
        return f"error: {type(exc).__name__}"


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg}


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("not arithmetic")

