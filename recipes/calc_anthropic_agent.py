"""The calculator agent of calc_openai_agent.py, written against the stock `anthropic` SDK instead.

Tool use goes through `tool_use` / `tool_result` blocks; the chat server's Anthropic front end records
the same token-exact segments as its OpenAI one. Reward: 1 if the last text reply contains the answer.
"""
import json

from anthropic import AsyncAnthropic

from agent import ChatAgent, ChatContext, Result
from recipes.calc_openai_agent import MAX_TURNS, calculate, rows  # noqa: F401  (rows is this file's data)

TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression with + - * and parentheses.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}]


class CalculatorAgent(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
        messages, reply = [{"role": m["role"], "content": m["content"]} for m in ctx.messages], ""
        for _ in range(MAX_TURNS):
            message = await client.messages.create(model=ctx.model, max_tokens=48, messages=messages, tools=TOOLS)
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in message.content]})
            reply = "".join(b.text for b in message.content if b.type == "text")
            calls = [b for b in message.content if b.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": calculate(json.dumps(c.input))}
                for c in calls]})
        return Result(reward=float(str(ctx.label) in reply))


def make_agent() -> ChatAgent:
    return CalculatorAgent()
