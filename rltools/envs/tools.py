"""ToolEnvironment (`env.type: tools`): the model may end a turn with a call of one of `env.tools`;
the environment answers it and the model goes on. A turn that ends without a call ends the episode.

A call is a turn that ends (trailing whitespace aside) with a tool's closing tag, which is also a
`stop` string, so the generator ends the turn there; the call is what follows the last opening tag
before it. Formats (docs/tools.md):

    calculator  <calc>37*48</calc>                    -> <result>1776</result>
    python      <tool_call>\\n{"name": "python", "arguments": {"code": "print(2**10)"}}\\n</tool_call>
                                                      -> <tool_response>\\n1024\\n</tool_response>

Every answer, errors included, goes through `env.observation_template`. `env.max_turns` is the
generator's to enforce: this environment answers every call it is given.
"""

from ..config.schema import EnvConfig
from ..sandbox.host import check_host
from . import calculator, python_tool
from .base import Environment, Reply


class ToolEnvironment(Environment):
    """One episode's tool calls (calculator and/or python). Holds no sandbox between calls: the
    python tool's sandboxes come from a pool shared by the process (see python_tool)."""

    def __init__(self, config: EnvConfig):
        if config.type != "tools" or not config.tools:
            raise ValueError(f"ToolEnvironment needs env.type: tools and env.tools, got {config.type!r}, "
                             f"{config.tools}")
        try:
            config.observation_template.format(observation="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"env.observation_template {config.observation_template!r} cannot be filled "
                             f"({type(err).__name__}: {err}); it may use only {{observation}}, literal "
                             "braces doubled") from None
        self.config = config
        self.tools = tuple(dict.fromkeys(config.tools))
        closing = {"calculator": calculator.CLOSE, "python": python_tool.CLOSE}
        self.stop = tuple(closing[tool] for tool in self.tools)
        if "python" in self.tools:
            check_host()  # a node without bubblewrap fails here, at the start, not at the first call
            self.limits = python_tool.limits_for(config.tool_timeout_s)

    def step(self, turn: str) -> Reply:
        text = turn.rstrip()
        if "calculator" in self.tools and text.endswith(calculator.CLOSE):
            observation, error = self._calculator(text)
        elif "python" in self.tools and text.endswith(python_tool.CLOSE):
            observation, error = self._python(text)
        else:
            return Reply(None)
        return Reply(self.config.observation_template.format(observation=observation), True, error)

    def _calculator(self, text: str) -> tuple[str, bool]:
        body = text[: -len(calculator.CLOSE)]
        start = body.rfind(calculator.OPEN)
        if start < 0:
            return f"<result>{calculator.ERROR}</result>", True
        return calculator.answer(body[start + len(calculator.OPEN):])

    def _python(self, text: str) -> tuple[str, bool]:
        body = text[: -len(python_tool.CLOSE)]
        start = body.rfind(python_tool.OPEN)
        if start < 0:
            return python_tool.error_response(f"{python_tool.CLOSE} without {python_tool.OPEN}"), True
        try:
            code = python_tool.parse_call(body[start + len(python_tool.OPEN):])
        except python_tool.CallError as err:
            return python_tool.error_response(str(err)), True
        return python_tool.run_python(code, self.limits, self.config.tool_output_chars)
