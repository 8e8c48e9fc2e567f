"""One path from any dialect's chat request to a scheduled Request.

Each router translates its body into a ``ChatCall`` (OpenAI-shaped template
messages, function tools, a tool choice, the raw fields for thinking, sampling
and session ids); everything after that — healing, rendering, thinking flags,
cache hints, the output parser — is shared, so the three dialects send the model
the same tokens for the same conversation and hit the same cached prefixes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from app.errors import APIError
from app.generation_params import resolve_max_tokens, resolve_sampling
from app.image_prompt import ResolvedImages, attach_images, plain_replies, resolve_images
from app.protocol.output_parser import OutputParser, Syntax
from app.protocol.thinking import resolve_effort, resolve_thinking
from app.protocol.tool_formats import ToolCallDecoder, forced_opening
from app.protocol.tool_schema import ToolChoice
from app.request_fields import SamplingFields
from app.session_id import session_id_from
from app.state import AppState
from kvcache.healing import decoded_arguments
from kvcache.index import VolatilePolicy
from kvcache.prompt_key import PromptKey, RenderedPrompt
from kvcache.sessions import fallback_session_id
from observability.escape import ascii_escaped
from scheduler.admission import AdmissionError
from scheduler.contracts import ImageFront, ModelInfo, TextSyntax
from scheduler.request import CacheHints, ReasoningTags, Request, SamplingParams

log = logging.getLogger("kvwarm.http")


@dataclass
class ChatCall:
    """A chat request in the neutral shape every dialect is translated into."""

    messages: list[dict[str, Any]]  # role/content/tool_calls/tool_call_id/reasoning_content
    fields: Mapping[str, Any]  # the raw body: sampling, thinking, session, template kwargs
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI function tools
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True  # False: the reply's first call only
    max_tokens: int | None = None
    # Anthropic clients must send max_tokens and send it large (Claude Code: 32000):
    # fit it to the room the context and KV budget leave instead of refusing
    clamp_max_tokens: bool = False
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # thinking when the request does not say; None: the server's --thinking. Anthropic
    # clients leave ``thinking`` out to mean off (title and side requests do)
    thinking_default: bool | None = None
    sampling: SamplingFields = field(default_factory=SamplingFields)  # validated at the boundary
    ignored: tuple[str, ...] = ()  # fields the client sent that nothing acts on
    use_kv_cache: bool = True  # false: neither reuse nor store KV for this request
    kv_bits: int | None = None  # store (and reuse) this request's KV at this precision
    adapter: str | None = None  # a mounted LoRA adapter's id; None: the base model
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # checked at the boundary
    logprobs: int | None = None  # None: none; N: each token's, with N alternatives
    count_only: bool = False  # count_tokens: a prompt over the context is still counted
    messages_field: str = "messages"  # what the dialect calls them, for errors (Responses: input)
    # whether ``messages[i]`` is the client's i-th message (chat); a translated
    # dialect's errors name the field alone rather than a shifted index
    same_indices: bool = True
    prefill: str = ""  # the reply starts with this text (Anthropic's final assistant message)


@dataclass
class Prepared:
    request: Request
    parser: OutputParser
    answered: str | None  # healing context (what the reply answers); None: not a chat turn
    ignored: tuple[str, ...] = ()  # fields the client sent that nothing acts on
    conversation_id: str = ""  # the session the KV cache files this turn under
    # max_tokens was lowered to the room the context leaves (``clamp_max_tokens``): a
    # reply cut at the limit was cut by the context window, not by the client's limit
    max_tokens_lowered: bool = False
    short_call_ids: bool = False  # the template's tool-call ids are 9 alphanumerics

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Kvwarm-Ignored-Fields": shown_names(self.ignored)} if self.ignored else {}


def shown_names(names: tuple[str, ...]) -> str:
    """Client-chosen field names for a header or a log line: escaped to ASCII (a
    header is latin-1; a newline would forge a log line) and bounded."""
    shown = [ascii_escaped(n, 64) for n in names[:16]]
    more = f", and {len(names) - 16} more" if len(names) > 16 else ""
    return ", ".join(shown) + more


def template_tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """OpenAI tool calls with arguments as objects: chat templates iterate them."""
    if not calls:
        return None
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):  # not JSON, or too deep: a template can print the string
            fn["arguments"] = decoded_arguments(args) if args.strip() else {}
        out.append({**call, "type": call.get("type", "function"), "function": fn})
    return out


def parse_openai_tool_choice(value: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    """OpenAI's ``none``/``auto``/``required`` or ``{"type": "function", "function": {"name"}}``;
    Responses puts the name at the top level."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise APIError(400, f"Unknown tool_choice {value!r}.", param="tool_choice")
        return choice_of(value, tools)
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else value.get("name")
        if value.get("type") == "function" and isinstance(name, str):
            return forced_tool(name, tools)
        if value.get("type") in ("none", "auto", "required"):
            return choice_of(value["type"], tools)
    raise APIError(
        400, "tool_choice must be none, auto, required or a function.", param="tool_choice"
    )


def choice_of(mode: str, tools: list[dict[str, Any]]) -> ToolChoice:
    """``mode`` (none, auto, required) for a request with ``tools``: a call cannot
    be required when there is nothing to call."""
    if mode == "required" and not tools:
        raise APIError(
            400,
            "tool_choice requires a tool call, but the request has no function tools.",
            param="tool_choice",
        )
    return ToolChoice(mode)


def forced_tool(name: str, tools: list[dict[str, Any]]) -> ToolChoice:
    if not any(t["function"]["name"] == name for t in tools):
        raise APIError(
            400, f"tool_choice names {name!r}, which is not in tools.", param="tool_choice"
        )
    return ToolChoice("required", name)


INSTRUCTION_ROLES = ("system", "developer")


def one_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with one system message, first, for templates that refuse any
    other: the leading system (and developer) messages joined by a blank line, and
    later ones as user turns (joined to the first, each would change the prefix
    every later turn reuses). None when there is nothing to change."""
    n = 0
    while n < len(messages) and messages[n].get("role") in INSTRUCTION_ROLES:
        n += 1
    later = any(m.get("role") in INSTRUCTION_ROLES for m in messages[n:])
    if n < 2 and not later:
        return None
    head = messages[:n]
    if n >= 2:
        texts = [_text_of(m.get("content")) for m in head]
        head = [{"role": "system", "content": "\n\n".join(t for t in texts if t)}]
    tail = [
        {**m, "role": "user"} if m.get("role") in INSTRUCTION_ROLES else m for m in messages[n:]
    ]
    return [*head, *tail]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return ""


def _template_kwargs(call: ChatCall, syntax: TextSyntax, thinking: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if "preserve_thinking" in syntax.template_vars:
        kwargs["preserve_thinking"] = True  # past reasoning stays in the prompt: a stable prefix
    effort = resolve_effort(call.fields) if "reasoning_effort" in syntax.template_vars else None
    if effort is not None and thinking:  # the level the client asked, not the template's default
        kwargs["reasoning_effort"] = effort
    kwargs.update(call.template_kwargs)
    kwargs["enable_thinking"] = thinking
    if "thinking" in syntax.template_vars:  # DeepSeek-V3.1's templates name it so
        kwargs["thinking"] = thinking
    if call.tools:
        # shown even under tool_choice none / a named tool: the tools block is part of
        # the stable prefix every turn of the conversation reuses
        kwargs["tools"] = call.tools
    return kwargs


def _opens_reasoning(tail: str, prefill: str, syntax: TextSyntax) -> bool:
    """Whether the reply starts inside a think block: the generation prompt opens
    one (DeepSeek-R1, Qwen3 thinking), unless a prefill closes it, or a prefill
    opens one it does not close."""
    start, end = syntax.think_start, syntax.think_end
    if not start:
        return False
    opened = tail.rstrip().endswith(start)
    last_start = prefill.rfind(start)
    last_end = prefill.rfind(end) if end else -1
    if last_start != last_end:  # the prefill says which of the two came last
        opened = last_start > last_end
    return opened


def _output_side(
    call: ChatCall, info: ModelInfo, rendered: RenderedPrompt
) -> tuple[PromptKey, OutputParser, ReasoningTags | None]:
    """The parser for the reply and the final prompt: a forced tool choice appends
    the opening of the call, and the parser starts inside it. And the think tags
    as the parser reads them, for the engine's stop strings (None: the reply
    starts in a forced call, where no block can open)."""
    syntax = info.syntax
    opened = _opens_reasoning(rendered.tail, call.prefill, syntax)
    parses = bool(call.tools) and call.tool_choice.parses
    markup = (syntax.tool_call_start or "", syntax.tool_call_end or "")
    decoder = (
        ToolCallDecoder(call.tools, syntax.tool_family, markup, call.tool_choice.allowed)
        if parses
        else None
    )
    parser = OutputParser(
        Syntax(syntax.think_start, syntax.think_end, starts_in_reasoning=opened),
        decoder,
        max_calls=None if call.parallel_tool_calls else 1,
    )
    key = rendered.key
    if call.prefill:
        if info.vision is not None and info.vision.image_token in call.prefill:
            raise APIError(
                400,
                f"The final assistant message contains this model's image marker "
                f"{info.vision.image_token!r}.",
                param=f"{call.messages_field}.{len(call.messages)}.content",
            )
        if parses and call.tool_choice.mode == "required":
            raise APIError(
                400,
                "A final assistant message (prefill) cannot be continued while tool_choice "
                "forces a tool call.",
                param="tool_choice",
            )
    appended = call.prefill
    tags = (
        ReasoningTags(syntax.think_start, syntax.think_end, opened)
        if syntax.think_start and syntax.think_end
        else None
    )
    if parses and call.tool_choice.mode == "required":
        forced = forced_opening(syntax.tool_family, call.tool_choice.name)
        closing = f"{syntax.think_end}\n\n" if opened and syntax.think_end else ""
        appended += closing + forced.text
        parser.open_tool(forced.markup, forced.seed)
        tags = None
    if appended:
        key = info.formatter.continued(rendered, appended)
    return key, parser, tags


def _image_salts(
    messages: list[dict[str, Any]], images: ResolvedImages, front: ImageFront | None
) -> list[bytes] | None:
    """Per message, the digests of its images: every image is the same placeholder
    in the text, and a reply about one must not heal back beside another."""
    if front is None or not images.images:
        return None
    pending = iter(images.images)  # in prompt order, one per placeholder
    salts = []
    for message in messages:
        content = message.get("content")
        count = content.count(front.placeholder) if isinstance(content, str) else 0
        salts.append(b"".join(image.digest for image in islice(pending, count)))
    return salts


def _completion_limit(
    call: ChatCall, info: ModelInfo, prompt_len: int, default: int
) -> tuple[int, bool]:
    """The reply's token limit, and whether the client's was lowered to fit."""
    limit = call.max_tokens
    lowered = False
    if call.clamp_max_tokens and limit is not None:
        room = min(info.context_length, info.budget.ceiling_tokens) - prompt_len
        if 1 <= room < limit:
            log.info("max_tokens %d lowered to %d: the room this prompt leaves", limit, room)
            limit, lowered = room, True
    resolved = resolve_max_tokens(
        limit, prompt_len, info.context_length, default, info.budget.ceiling_tokens
    )
    return resolved, lowered


def _sampling(call: ChatCall, info: ModelInfo) -> SamplingParams:
    return resolve_sampling(call.sampling, info.generation_defaults, info.vocab_size)


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """What every template renders whole: the model's own turns are left out, as
    templates drop their past reasoning (Qwen3's), which a chain of stored
    Responses carries along, counted, a conversation that fits was refused."""
    texts = []
    for message in messages:
        if message.get("role") == "assistant":
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
    return texts


def prepare_chat(call: ChatCall, state: AppState, headers: Mapping[str, str]) -> Prepared:
    info = state.model_info()
    settings = state.settings
    adapter = state.adapter(call.adapter, call.fields.get("model"))
    if not call.messages:
        raise APIError(
            400,
            f"The request has no messages (in {call.messages_field}).",
            param=call.messages_field,
        )
    default = settings.thinking == "on" if call.thinking_default is None else call.thinking_default
    thinking = resolve_thinking(call.fields, default)
    kwargs = _template_kwargs(call, info.syntax, thinking)
    relocate = settings.volatile_policy is VolatilePolicy.RELOCATE
    # every template renders what the messages say: a conversation that cannot fit
    # is refused before it is scanned or rendered (copying 30 MB through a template,
    # or a regex pass over it, holds the GIL for tens to hundreds of ms), and by its
    # text alone (a lower bound) before any image is fetched or decoded
    info.formatter.check_texts(_message_texts(call.messages), call.count_only)
    messages, images = resolve_images(
        call.messages,
        info.vision,
        settings.image_limits,
        settings.images == "placeholder",
        lambda i: (
            f"{call.messages_field}.{i}.content" if call.same_indices else call.messages_field
        ),
    )
    if images.numbers:  # with the images' placeholders or notes now in the text
        info.formatter.check_texts(_message_texts(messages), call.count_only)
    explicit_session = session_id_from(call.fields, headers)
    # healing is scoped by a conversation's own id only: a prompt_cache_key may be
    # one app's for all its users, whose replies must never heal into each other's
    scope = session_id_from(call.fields, headers, cache_key=False) or ""
    contexts = state.healing.contexts(messages, scope, _image_salts(messages, images, info.vision))
    healed = plain_replies(messages, state.healing.heal_all(messages, contexts), info.vision)

    def render(messages: list[dict[str, Any]]) -> Any:
        return info.formatter.render_chat(
            messages,
            relocate_volatile=relocate,
            count_only=call.count_only,
            image_placeholder=info.vision.placeholder if info.vision is not None else None,
            **kwargs,
        )

    try:
        try:
            rendered = render(healed)
        except AdmissionError:
            raise
        except Exception:
            # Qwen3.5/3.6's template refuses a second system message ("System message
            # must be at the beginning"), which Codex sends (instructions + developer,
            # and developer turns later on)
            merged = one_leading_system(healed)
            if merged is None:
                raise
            rendered = render(merged)
    except AdmissionError:
        raise  # a prompt no context could hold: 400 context_length_exceeded
    except Exception as exc:  # jinja errors of the model's own template
        raise APIError(400, f"The chat template rejected these messages: {exc}") from exc
    key, parser, reasoning = _output_side(call, info, rendered)
    prompt, image_inputs = list(key.model_tokens), ()
    if info.vision is not None:
        key, prompt, image_inputs = attach_images(key, images, info.vision)
    session = explicit_session or fallback_session_id(rendered.key.canonical)
    max_tokens, lowered = _completion_limit(call, info, len(prompt), settings.max_tokens)
    request = Request(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        sampling=_sampling(call, info),
        stop=call.stop,
        ignore_eos=call.ignore_eos,
        # a reply continuing a prefill keeps its first space ("The answer is" + " 42")
        trim_leading_space=not call.prefill,
        reasoning=reasoning,  # client stop strings match the answer, not the reasoning
        cache=CacheHints(
            key, session, rendered.message_hashes, call.kv_bits, own_conversation=bool(scope)
        )
        if call.use_kv_cache
        else None,
        adapter=adapter,
        images=image_inputs,
        logprobs=call.logprobs,
    )
    if call.ignored:
        log.info("%s: ignored fields: %s", request.request_id, shown_names(call.ignored))
    return Prepared(
        request, parser, contexts[-1], call.ignored, session, lowered, info.syntax.short_call_ids
    )
