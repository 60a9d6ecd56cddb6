"""OpenAI-compatible request bodies (pydantic v2) and the OpenAI error shape.

Request models are strict (`"5"` is not an integer, `true` is not a number, NaN is not a
float) and forbid unknown fields, as the OpenAI API itself does ("Unrecognized request
argument supplied"). OpenAI fields we do not implement and that would change the output
(suffix, best_of, ...) are therefore rejected with a 400 naming the field instead of being
silently ignored. Fields that never change the output (`store`, `metadata`, `user`, ...) are
accepted and ignored: they are listed once, in `IgnoredFields`, and the server logs the ones a
request set at DEBUG. Numeric ranges are declared on the fields, so `/openapi.json`
(generated from these models) states them. The one place unknown fields are allowed is a chat
*message*: templates
may read extra keys (tool_calls, reasoning_content, ...), so they reach `apply_chat_template`
after `server/chat_messages.py` has normalized them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_SEED = 2**63 - 1
TokenId = Annotated[int, Field(ge=0)]
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class RequestError(Exception):
    """An error to send to the client as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.error_type = status, message, param, code, error_type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


def internal_error(request_id: str | None) -> RequestError:
    """What a client sees of a bug or an engine failure: no details (they go to the log)."""
    return RequestError(
        500, f"internal error (request id {request_id})", code="internal_error", error_type="internal_error"
    )


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) in every chunk


class IgnoredFields(_Strict):
    """OpenAI fields that never change the output: accepted, logged at DEBUG, otherwise ignored.

    The one list of them; a value outside its OpenAI type is still a 400 (e.g. `modalities:
    ["audio"]` would change the output, so only `["text"]` is accepted).
    """

    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None  # OpenAI's end-user id
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # no reasoning models yet
    modalities: list[Literal["text"]] | None = None


IGNORED_FIELDS = tuple(IgnoredFields.model_fields)


def ignored_fields_set(body: BaseModel) -> list[str]:
    """The ignored fields this request set (for the debug log)."""
    return [name for name in IGNORED_FIELDS if name in body.model_fields_set]


class _SamplingRequest(IgnoredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extensions).

    The ranges are those `runtime.types.SamplingParams` enforces (a test keeps them equal).
    """

    model: str | None = None  # None: the served model (vLLM's choice: a request without `model` is served)
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; -1 or 0 disables
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM extension
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    seed: int | None = Field(default=None, ge=-MAX_SEED - 1, le=MAX_SEED)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # vLLM extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension
    include_stop_str_in_output: bool = False  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension
    priority: int = 0  # vLLM extension; lower runs earlier under the priority policy
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> bias in [-100, 100]
    # Structured output (checked in server/structured.py, which names the offending field):
    response_format: dict[str, Any] | None = None  # OpenAI: {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"json" | "regex" | "choice" | "grammar": ...}
    kv_transfer_params: dict[str, Any] | None = None  # vLLM extension: P/D (docs/disaggregation.md)

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, or null") from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    # Checked by `_prompt_shape`; the annotation states the same rules for the OpenAPI document.
    prompt: (
        NonEmptyText
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # with logprobs: the prompt's logprobs come first (first token null)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM extension

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler):
        # Checked by hand: pydantic's union would try every member and collect an error per
        # element, which takes seconds on a 10 MB list of token ids.
        if (
            (isinstance(value, list) and value and all(isinstance(item, str) for item in value))
            or isinstance(value, str)
            or _is_token_ids(value)
            or (isinstance(value, list) and value and all(_is_token_ids(item) for item in value))
        ):
            prompt = value
        else:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids (non-negative integers) "
                "or a list of lists of token ids"
            )
        if not prompt or (
            isinstance(prompt, list) and any(len(item) == 0 for item in prompt if not isinstance(item, int))
        ):
            raise ValueError("must not be empty")
        return prompt


def _is_token_ids(value: Any) -> bool:
    if not isinstance(value, list):
        return False
    return not value or (set(map(type, value)) == {int} and min(value) >= 0)  # C-speed on huge lists


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; unknown keys are kept for the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_shape(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError('must be a string, a list of {"type": "text", "text": ...} parts, or null') from None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM extension
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension, e.g. {"enable_thinking": false}
    chat_template: str | None = None  # vLLM extension; refused unless --trust-request-chat-template
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, checked in server/structured.py
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True

    def request_chat_template(self) -> str | None:
        """The client-supplied template, from `chat_template` or `chat_template_kwargs.chat_template`."""
        if self.chat_template is not None:
            return self.chat_template
        return (self.chat_template_kwargs or {}).get("chat_template")


class TokenizeRequest(_Strict):
    """POST /tokenize: either `prompt` or `messages` (vLLM's shape)."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [  # exactly one of them, not null
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a raw JSON body; a `RequestError(400)` names the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        raise _as_request_error(err) from None


def _as_request_error(err: ValidationError) -> RequestError:
    issue = err.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in issue["loc"]]
    param = ".".join(loc) or None
    kind, message = issue["type"], issue["msg"]
    if kind == "json_invalid":
        return RequestError(400, f"The request body is not valid JSON: {message.removeprefix('Invalid JSON: ')}")
    if kind == "model_type" and not loc:
        return RequestError(400, "The request body must be a JSON object")
    if kind == "extra_forbidden":
        return RequestError(400, f"{param}: unknown or unsupported field", param=param)
    if kind == "missing":
        return RequestError(400, f"{param}: field required", param=param)
    message = message.removeprefix("Value error, ")
    return RequestError(400, f"{param}: {message}" if param else message, param=param)
