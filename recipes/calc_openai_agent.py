"""A multi-turn calculator agent written against the stock `openai` SDK: it trains as it is.

The agent asks the model, runs every `calculator` tool call it gets, sends the results back, and stops
at a reply with no tool call or after MAX_TURNS. Reward: 1 if the last reply contains the right answer.
Nothing here knows about training: the chat server behind `ctx.base_url` records the token-exact segments.
"""
import json
import random

from openai import AsyncOpenAI

from agent import ChatAgent, ChatContext, Result

MAX_TURNS = 4
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def rows(split: str) -> list[dict]:
    rng = random.Random({"train": 0, "test": 1}[split])
    out = []
    for _ in range(200):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"prompt": f"What is {a} * {b}? Use the calculator.", "label": str(a * b), "tools": TOOLS})
    return out


def calculate(arguments: str) -> str:
    try:
        expression = json.loads(arguments)["expression"]
        if not set(expression) <= set("0123456789+-*() "):
            return "error: only digits, + - * and parentheses"
        return str(eval(expression, {"__builtins__": {}}))  # the character check above leaves only arithmetic
    except Exception as e:  # the model's arguments are arbitrary text: report, do not crash the episode
        return f"error: {type(e).__name__}"


class CalculatorAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
        messages, reply = list(ctx.messages), ""
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools,
                                                            max_tokens=48)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            reply = message.content or ""
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculate(call.function.arguments)})
        return Result(reward=float(str(ctx.label) in reply))


def make_agent() -> ChatAgent:
    return CalculatorAgent()
