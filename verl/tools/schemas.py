"""The values a tool exchanges with the rollout (veRL's `verl.tools.schemas`), as pydantic models.

`OpenAIFunctionToolSchema` is what a tool config's `tool_schema:` holds (an OpenAI function tool);
`ToolResponse` is what `create` and `execute` answer: its `text` becomes the `tool` message the
chat template renders. Departure from veRL, on purpose: a schema keeps keys veRL's models would
drop (a property's `items`, `item`, `default`, ...), so `model_dump()` gives back what the YAML
wrote and the model is shown exactly that text; and it accepts the JSON Schemas MCP servers list
(no `required`, no `description`, a property typed by a list or by `anyOf`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function (JSON Schema; keys beyond these are kept)."""

    model_config = ConfigDict(extra="allow")

    type: Any = None            # veRL: a required string; here also a list of types, or absent (anyOf, $ref)
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """A function's parameters: an object schema."""

    model_config = ConfigDict(extra="allow")

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


def _no_parameters() -> OpenAIFunctionParametersSchema:
    return OpenAIFunctionParametersSchema(type="object", properties={}, required=[])


class OpenAIFunctionSchema(BaseModel):
    """A function: its name (what the model calls), description and parameters."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=_no_parameters)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool as the chat template is given it: `{"type": "function", "function": {...}}`."""

    model_config = ConfigDict(extra="allow")

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as parsed from the model's text: the arguments still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with its arguments decoded."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
            parsed_schema: OpenAIFunctionParsedSchema) -> tuple[OpenAIFunctionCallSchema, bool]:
        """(call, has_decode_error): arguments that are not a JSON object become {} and the flag is set."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(BaseModel):
    """A call with its id, in OpenAI's message layout."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """A tool's answer. Only `text` reaches the model here (text-only rollouts); `image` / `video`
    are accepted as veRL's lists and refused by the rollout with a message if set."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _lists_only(cls, values: Any) -> Any:
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(f"ToolResponse.{key} must be a list (wrap a single one: [{key}]), "
                                     f"got {type(values[key]).__name__}")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


__all__ = ["OpenAIFunctionCallSchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionParsedSchema",
           "OpenAIFunctionPropertySchema", "OpenAIFunctionSchema", "OpenAIFunctionToolCall",
           "OpenAIFunctionToolSchema", "ToolResponse"]
