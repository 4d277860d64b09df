"""What the model is given: a row's prompt (text or chat messages) rendered in the model's own format.

Two formats (`data.chat_template`):
- chat ("model", or a Jinja file): the row's messages (a text prompt becomes one user message, after
  `data.prompt_template`; `data.system_prompt` leads where the row has no system message) rendered by
  the chat template with the generation prompt, as `tokenizer.apply_chat_template(messages,
  add_generation_prompt=True, **data.chat_template_kwargs)` renders them; its tokens are the
  rendered text's tokens without special tokens added (the template wrote them).
- raw ("none"): the text prompt through `data.prompt_template`, tokenized with the tokenizer's special
  tokens (BOS), as vLLM tokenizes a text prompt.

Invariants:
- One path: the generator, `rltools eval`, the multi-turn episodes and preflight's preview all render
  through `PromptFormat.render`, and the job tokenizes with `PromptFormat.tokenize`, so the prompt
  tokens the trainer trains on are exactly the template's (`tokenizer.apply_chat_template(...,
  tokenize=True)`: tested token for token).
- Light: the template and the special tokens are read from the model directory's files
  (chat_template.jinja, tokenizer_config.json) and rendered with transformers' own Jinja renderer
  (no torch), or on a login node without transformers by a Jinja environment set up as transformers'
  (tested equal), so `submit` shows the first rendered prompt there.
- A bad input is a UserError naming the key, the file or the row: a model without a template under
  "model", messages under a raw format or under a non-trivial `data.prompt_template`, a message
  that is not {role, content}.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config.schema import DataConfig
from ..errors import UserError

RAW_TEXT = "{prompt}"
ROLES = ("system", "user", "assistant", "tool")


def template_default(data_type: str, chat: bool) -> str:
    """`data.prompt_template`'s default: the text as is; raw arithmetic ends with "=", the answer cue the
    tiny models were pretrained on (their chat template writes it as the assistant's turn)."""
    return "{prompt}=" if data_type in ("arithmetic", "products") and not chat else RAW_TEXT


@dataclass(frozen=True)
class PromptFormat:
    template: str | None
    """The chat template (Jinja); None: raw text."""
    prompt_template: str
    system_prompt: str | None = None
    special_tokens: dict = field(default_factory=dict)
    """bos_token, eos_token, ... as the template sees them (the tokenizer's special tokens map)."""
    kwargs: dict = field(default_factory=dict)
    source: str = ""
    """Where the template came from, for messages."""

    @property
    def chat(self) -> bool:
        return self.template is not None

    def render(self, prompt, where: str = "") -> str:
        """The text the model is given for a row's prompt (a string or a list of {role, content})."""
        at = f"{where}: " if where else ""
        if not self.chat:
            if not isinstance(prompt, str):
                raise UserError(f"{at}the prompt is a list of chat messages, but data.chat_template is none (raw text): "
                                "set data.chat_template: model (the tokenizer's template) or a .jinja file")
            return fill(self.prompt_template, prompt)
        messages = self.messages(prompt, at)
        try:
            return _render(self.template, messages, {**self.special_tokens, **self.kwargs})
        except Exception as err:  # jinja2's TemplateError, the template's raise_exception, a missing variable
            raise UserError(f"{at}the chat template ({self.source}) cannot render this row: {type(err).__name__}: "
                            f"{err}") from None

    def messages(self, prompt, at: str = "") -> list[dict]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": fill(self.prompt_template, prompt)}]
        else:
            if self.prompt_template != RAW_TEXT:
                raise UserError(f"{at}the prompt is a list of chat messages, which data.prompt_template "
                                f"{self.prompt_template!r} cannot fill (it formats text prompts): set "
                                "data.prompt_template: '{prompt}' and put instructions in the messages or in "
                                "data.system_prompt")
            messages = [check_message(m, at) for m in prompt]
            if not messages:
                raise UserError(f"{at}the prompt is an empty list of messages")
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def tokenize(self, tokenizer, text: str) -> list[int]:
        """The prompt's token ids: a chat template wrote its special tokens itself."""
        return list(tokenizer.encode(text, add_special_tokens=not self.chat))


def _render(template: str, messages: list[dict], variables: dict) -> str:
    """transformers' own rendering (apply_chat_template's) where transformers is installed (in the job);
    on a login node without it, a Jinja environment set up as transformers sets up its own."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return _login_environment().from_string(template).render(messages=messages, add_generation_prompt=True,
                                                                  **variables)
    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, **variables)
    return rendered[0]


def _login_environment():
    """transformers 5.19's chat template environment (chat_template_utils._cached_compile_jinja_template):
    sandboxed, trim_blocks and lstrip_blocks, loop controls, raise_exception, strftime_now, a tojson
    that does not escape HTML, and `{% generation %}` blocks rendered as their body."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def fill(template: str, text: str) -> str:
    try:
        return template.format(prompt=text)
    except (KeyError, IndexError, ValueError) as err:
        raise UserError(
            f"data.prompt_template {template!r} cannot be filled ({type(err).__name__}: {err}); it may use only "
            "{prompt}, and literal braces are written doubled: \\boxed{{}}"
        ) from None


def check_message(message, at: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("content"), str) \
            or message.get("role") not in ROLES:
        raise UserError(f"{at}a chat message must be {{'role': one of {', '.join(ROLES)}, 'content': text}}, got "
                        f"{message!r:.120}")
    return {"role": message["role"], "content": message["content"]}


def prompt_format(data: DataConfig, model_path: str | Path) -> PromptFormat:
    """The format `data` (a DataConfig) asks for, with the model at `model_path`."""
    chat = data.chat_template != "none"
    prompt_template = data.prompt_template if data.prompt_template is not None else template_default(data.type, chat)
    if not chat:
        return PromptFormat(None, prompt_template)
    model_path = Path(model_path)
    if data.chat_template == "model":
        template, source = model_template(model_path)
    else:
        source = data.chat_template
        try:
            template = Path(source).read_text(encoding="utf-8")
        except OSError as err:
            raise UserError(f"data.chat_template {source}: cannot read it ({err.strerror})") from None
    return PromptFormat(template, prompt_template, data.system_prompt, special_tokens(model_path),
                        dict(data.chat_template_kwargs), source)


def model_template(model_path: Path) -> tuple[str, str]:
    """The model's chat template and the file it is in; UserError when it has none."""
    jinja = model_path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config = _tokenizer_config(model_path)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers' default is "default"
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    if isinstance(template, str) and template.strip():
        return template, str(model_path / "tokenizer_config.json")
    raise UserError(
        f"model.path {model_path} has no chat template (no chat_template.jinja, no chat_template in "
        "tokenizer_config.json), and data.chat_template is model: set data.chat_template: none to give the "
        "model raw text through data.prompt_template (a base model), or the path of a .jinja template"
    )


def special_tokens(model_path: Path) -> dict:
    """The special tokens a template may use, as transformers' special_tokens_map gives them to it."""
    config = _tokenizer_config(model_path)
    tokens = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = config.get(key)
        if isinstance(value, dict):  # older files: an AddedToken's fields
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _tokenizer_config(model_path: Path) -> dict:
    path = model_path / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: not readable JSON ({err})") from None
