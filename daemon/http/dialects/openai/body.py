"""OpenAI's chat completions body: the core's chat job body (core/conversation.py's
ChatJobRequest) with what only OpenAI's API has. Its deprecated `functions` and
`function_call` are refused, never ignored: a client sending them expects a
call, and one silently dropped would answer in text instead."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from daemon.http.core.conversation import ChatJobRequest


class ChatCompletionRequest(ChatJobRequest):
    functions: Any = Field(None, description="refused: OpenAI's deprecated form of tools")
    function_call: Any = Field(None, description="refused: OpenAI's deprecated form of tool_choice")
    verbose: bool = Field(False, description="llama-server's: the whole answer carries `__verbose`, the prompt as the "
                                             "chat template rendered it (a stream does not)")

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is OpenAI's deprecated form of tools; send tools (and tool_choice)")
        return value
