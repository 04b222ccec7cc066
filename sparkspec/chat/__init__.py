"""Chat formats beyond a checkpoint's Jinja template: DeepSeek-V4's encoding (prompt text and token ids),
its output parsing (reasoning, content, DSML tool calls; whole or streamed), and the choice of format.

    prompt = encode_messages(messages, tools, mode="thinking", reasoning_effort="max")
    ids = prompt.token_ids(tokenizer)
    parser = StreamParser(thinking=True, parse_tools=bool(tools))
    delta = parser.feed(piece) ... parser.finish()
"""

from sparkspec.chat.detect import CHAT_FORMATS, ChatFormat, detect_chat_format, has_dsv4_markers, resolve_chat_format
from sparkspec.chat.dsv4_encoding import MODES, REASONING_EFFORTS, Mode, Prompt, ReasoningEffort, encode_messages
from sparkspec.chat.dsv4_output import Delta, ParsedCompletion, StreamParser, new_tool_call_id, parse_completion

__all__ = [
    "CHAT_FORMATS", "MODES", "REASONING_EFFORTS", "ChatFormat", "Delta", "Mode", "ParsedCompletion", "Prompt",
    "ReasoningEffort", "StreamParser", "detect_chat_format", "encode_messages", "has_dsv4_markers",
    "new_tool_call_id", "parse_completion", "resolve_chat_format",
]
