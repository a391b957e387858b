"""The bodies of POST /v1/chat/completions and /v1/completions, declared once: their fields,
types and caps, the checks across fields, and what the validated body hands on (messages as
the chat template takes them, the tools, the one output constraint, the sampling fields).

Caps come from contract/sampling_params.py (what the runtime accepts) and the constants here
(what no body may exceed, so that no body makes work beyond its size). SamplingParams' own
check still runs when the gateway builds it: the models state the same ranges so that the
OpenAPI document does, and refuse early.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints, Tag, model_validator
from pydantic.json_schema import WithJsonSchema

from contract.sampling_params import (
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_SEED,
)
from gateway.errors import bad_request
from gateway.openai.schema.base import Body, by_key, by_kind
from gateway.openai.schema.structured import Refused, StructuredFields, sent_constraints
from gateway.openai.schema.tools import ToolCalls, ToolChoice, Tools, choice_value
from gateway.openai.tools import ToolSpec, check_raw_tools, tool_spec

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 8
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_TEMPERATURE = 2.0
# caps on the arrays a client sends, so that no body makes work beyond its size: even an
# empty message renders to a few tokens, so more than this cannot fit any context we serve
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 64
# fields that change what the model must produce; ignoring them would return a wrong answer
UNSUPPORTED = ("functions", "logit_bias", "suffix")
# reasoning_effort -> the reasoning budget it stands for, in tokens (None: no budget). The
# values are OpenAI's; the budgets ours, for models that think in the open (a DeepSeek-R1
# distill writes about 1-4k tokens on a school problem): "none" skips the thinking (the end
# marker comes first), "max" leaves it unbounded. max_reasoning_tokens wins when both are sent.
REASONING_EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768,
    "max": None}
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

Int = int | None
Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
MaxTokens = Annotated[int, Field(ge=1)]
StopField = Annotated[Annotated[Stop, Tag("~string")]
                      | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS), Tag("~array")],
                      by_kind("must be a string or an array of strings")]


class TextPart(Body):
    type: Literal["text"]
    text: str


Content = Annotated[Annotated[str, Tag("~string")]
                    | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS), Tag("~array")],
                    by_kind("must be a string or an array of text parts")]


def joined(content: str | list) -> str:
    # separate parts read as separate paragraphs, as other OpenAI-compatible servers do
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class TextMessage(Body):
    role: Literal["system", "developer", "user"]
    content: Content

    def as_dict(self) -> dict:
        return {"role": self.role, "content": joined(self.content)}


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: Content | None = Field(None, description="null when it only called tools")
    tool_calls: ToolCalls | None = None

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"role": "assistant", "content": "" if self.content is None
                               else joined(self.content)}
        if self.tool_calls:
            out["tool_calls"] = tuple(call.as_dict() for call in self.tool_calls)
        return out


class ToolMessage(Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]

    def as_dict(self) -> dict:
        return {"role": "tool", "content": joined(self.content),
                "tool_call_id": self.tool_call_id}


Message = Annotated[Annotated[TextMessage, Tag("~text")]
                    | Annotated[AssistantMessage, Tag("~assistant")]
                    | Annotated[ToolMessage, Tag("~tool")],
                    by_key("role", {"system": "text", "developer": "text", "user": "text",
                                    "assistant": "assistant", "tool": "tool"})]


class StreamOptions(Body):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class GenerationFields(StructuredFields):
    """What both endpoints take."""

    model: str | None = Field(None, description="A served name (any other is 404 "
                                                "model_not_found); omitted: the first.")
    max_tokens: MaxTokens | None = Field(None, description="Output budget; default: the rest "
                                                           "of the context.")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, description="0 or -1 disables.")] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    stop: StopField | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    jump_forward: bool | None = Field(None, description="Append the tokens a grammar forces "
                                                        "without sampling them (default true).")
    n: Annotated[int, Field(ge=1, le=MAX_N, description="Choices to generate.")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="Only with stream.")
    priority: Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY,
                                   description="Lower is served first.")] | None = None
    user: str | None = None
    prompt_logprobs: Logprobs | None = Field(None, description=(
        "vLLM's: each prompt token's logprob, rank and this many alternatives; not with "
        "stream; the prefix cache serves none."))
    functions: Refused = None
    logit_bias: Refused = None
    suffix: Refused = None
    best_of: Refused = None

    def _shared_checks(self, kind: str, tools: Any = None) -> None:
        for name in UNSUPPORTED:
            if getattr(self, name):  # absent, null, empty: harmless
                raise bad_request(f"{name} is not supported by this server", name)
        if kind != "chat" and tools:  # no messages here to carry calls and results
            raise bad_request("tools are only supported on /v1/chat/completions", "tools")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported by this server; use n", "best_of")
        options = self.stream_options
        if options is not None and (options.model_fields_set or options.model_extra) \
                and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if self.stream and self.prompt_logprobs is not None:  # vLLM: they come in one piece
            raise bad_request("prompt_logprobs are not available when stream is true",
                              "prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, defaults: Any, logprobs: bool, top_logprobs: int,
                 structured: dict | None) -> dict[str, Any]:
        """Every SamplingParams field but max_tokens: as sent, else the model's default, else
        OpenAI's."""
        def pick(name: str, openai: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, openai)

        stop = self.stop
        return dict(
            temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
            top_k=pick("top_k", 0), min_p=float(pick("min_p", 0.0)), seed=self.seed,
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos), logprobs=logprobs, top_logprobs=top_logprobs,
            prompt_logprobs=self.prompt_logprobs, structured=structured,
            jump_forward=self.jump_forward is not False)


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = Field(None, description="Wins over max_tokens.")
    logprobs: bool | None = Field(None, description="Return each output token's "
                                                    "log-probability.")
    top_logprobs: Logprobs | None = Field(None, description="Alternatives per token; needs "
                                                            "logprobs.")
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="With tool_choice required: 1 "
                                                               "or more calls.")
    reasoning_effort: ReasoningEffort | None = Field(None, description=(
        "A reasoning model's thinking budget: none 0, minimal 256, low 1024, medium 4096, "
        "high 16384, xhigh 32768 tokens, max unbounded; ignored by models that do not think."))
    max_reasoning_tokens: Annotated[int, Field(ge=0)] | None = Field(None, description=(
        "Ours (llama.cpp's --reasoning-budget per request): the most tokens a reasoning model "
        "may think before its end marker is written for it; wins over reasoning_effort; "
        "ignored by models that do not think."))

    @model_validator(mode="before")
    @classmethod
    def _totals_first(cls, data: Any) -> Any:
        # the caps across tools and constraints, read off the raw body before any tool's or
        # constraint's schema is checked: an over-cap body costs O(its size), no schema work
        if isinstance(data, dict):
            check_raw_tools(data.get("tools"))
            tools, sent = data.get("tools"), sent_constraints(data)
            if isinstance(tools, list) and tools and sent and data.get("tool_choice") != "none":
                raise tools_and_constraint(sent[0])
        return data

    @model_validator(mode="after")
    def _across_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self._shared_checks("chat")
        return self

    def tool_spec(self) -> ToolSpec | None:
        """The request's tools and tool_choice (None: no tools), checked across tools."""
        if not self.tools and self.tool_choice is None:
            return None
        functions = tuple(t.function.function() for t in self.tools or ())
        parallel = True if self.parallel_tool_calls is None else self.parallel_tool_calls
        return tool_spec(functions, choice_value(self.tool_choice), parallel)

    def message_dicts(self) -> tuple[dict, ...]:
        return tuple(m.as_dict() for m in self.messages)

    def reasoning_budget(self) -> int | None:
        """The thinking budget in tokens (None: unbounded)."""
        if self.max_reasoning_tokens is not None:
            return self.max_reasoning_tokens
        return REASONING_EFFORT_BUDGETS[self.reasoning_effort or "max"]

    def output_budget(self) -> int | None:
        # max_completion_tokens is the newer name; when both are sent it wins, as in OpenAI's
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def prompt_value(value: Any) -> str | tuple[int, ...]:
    """A prompt as the engine takes it: a text or token ids (a batch of one is that one);
    /tokenize reads its prompt with this too, so both count the same tokens."""
    if value is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt is just that prompt
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(
            isinstance(p, (str, list)) for p in value):
        raise bad_request("several prompts in one request are not supported; "
                          "send one request per prompt", "prompt")
    raise bad_request("prompt must be a string or a non-empty array of token ids (integers "
                      ">= 0)", "prompt")


PROMPT_SCHEMA = {"oneOf": [
    {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "integer",
                                                                    "minimum": 0}},
    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}}]}


class CompletionRequest(GenerationFields):
    prompt: Annotated[Any, AfterValidator(prompt_value), WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: Logprobs | None = Field(None, description="Log-probabilities plus this many "
                                                        "alternatives.")
    echo: bool | None = Field(None, description="Prepend the prompt to the output.")
    tools: Refused = None

    @model_validator(mode="after")
    def _across_fields(self) -> CompletionRequest:
        self._shared_checks("completion", self.tools)
        return self


def _constraint(structured: dict | None, tools: ToolSpec | None) -> dict | None:
    """The one output constraint: the body's own, or the call a tool_choice forces."""
    if tools is not None and tools.choice != "none" and structured is not None:
        # a constraint on the whole output leaves no room for a call, and a forced call none
        # for the format: refused rather than one silently winning
        raise tools_and_constraint(structured["param"].split(".")[0])
    if tools is not None and tools.constrained:
        return tools.constraint()
    return structured


def tools_and_constraint(param: str) -> Exception:
    return bad_request(f"{param} cannot be combined with tools unless tool_choice is "
                       "\"none\"", param)


def generation_fields(req: ChatCompletionRequest | CompletionRequest,
                      defaults: Any) -> dict[str, Any]:
    """The fields of a GenerationRequest (gateway/openai/requests.py) from a validated body;
    `sampling` is not yet checked by SamplingParams' own rules (the caller does that)."""
    if isinstance(req, ChatCompletionRequest):
        logprobs, top_logprobs = bool(req.logprobs), req.top_logprobs or 0
        tools = req.tool_spec()
        fields: dict[str, Any] = dict(kind="chat", messages=req.message_dicts(), prompt=None,
                                      max_tokens=req.output_budget(), echo=False, tools=tools)
    else:  # here logprobs is an integer: the sampled token's logprob plus that many more
        logprobs, top_logprobs = req.logprobs is not None, req.logprobs or 0
        tools = None
        fields = dict(kind="completion", messages=None, prompt=req.prompt,
                      max_tokens=req.max_tokens, echo=bool(req.echo), tools=None)
    structured = _constraint(req.structured_spec(), tools)
    sampling = req.sampling(defaults, logprobs, top_logprobs, structured)
    if isinstance(req, ChatCompletionRequest) and req.reasoning_budget() is not None:
        sampling["reasoning_budget"] = req.reasoning_budget()
    return {**fields, "model": req.model, "n": req.n or 1, "stream": bool(req.stream),
            "include_usage": req.include_usage, "priority": req.priority or 0,
            "user": req.user, "structured": structured, "sampling": sampling}
