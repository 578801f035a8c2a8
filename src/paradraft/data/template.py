"""Chat templates -> token ids and the assistant loss mask.

The rule (one place): the loss mask covers exactly what the assistant generates at inference, namely the
text the template renders after the assistant header (the generation prompt) up to and including the
end-of-turn token. Role headers, system and user turns are never masked. Thinking blocks that the template
renders inside an assistant turn (Qwen3 `<think>`) are part of what the assistant generates, so they are masked.

Each segment (prompt part / assistant part) is tokenized separately, so token boundaries at the header are
the same as at inference, where the prompt ends with the generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

PROBE_USER = "Probe question 7f3a?"
PROBE_ANSWER = "Probe answer 9c1e."


class TemplateError(UserError, ValueError):
    """A tokenizer whose chat template cannot be used to find assistant turns."""


@dataclass(frozen=True)
class TemplateInfo:
    """What the loss-mask rule needs to know about a chat template."""

    header: str  # generation prompt that opens an assistant turn, e.g. "<|im_start|>assistant\n"
    end_of_turn: str  # token that closes an assistant turn, e.g. "<|im_end|>"


def set_chat_template(tokenizer, chat_template_file: str | None) -> None:
    """Install `--chat-template FILE` on the tokenizer, or fail clearly when it has none at all."""
    if chat_template_file:
        path = Path(chat_template_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            raise TemplateError(f"--chat-template {path}: no such file") from None
        except IsADirectoryError:
            raise TemplateError(f"--chat-template {path}: is a directory; give a Jinja template file") from None
        except UnicodeDecodeError:
            raise TemplateError(f"--chat-template {path}: not a text file (not UTF-8)") from None
        except OSError as e:
            raise TemplateError(f"--chat-template {path}: cannot be read ({e.strerror})") from None
        if not text.strip():
            raise TemplateError(f"--chat-template {path}: the file is empty")
        tokenizer.chat_template = text
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            f"pass --chat-template FILE with a Jinja chat template")
    where = f"--chat-template {chat_template_file}" if chat_template_file else \
        f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r}"
    try:  # a template that does not compile, or fails on the plainest conversation, is the user's to fix
        _render(tokenizer, [{"role": "user", "content": PROBE_USER}], add_generation_prompt=True)
    except Exception as e:  # jinja2 TemplateSyntaxError / UndefinedError / TypeError raised inside the template
        line = getattr(e, "lineno", None)
        raise TemplateError(f"{where}: cannot be rendered{f' (line {line})' if line else ''}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def special_token_strings(tokenizer) -> list[str]:
    """Every special / added token string of the tokenizer, longest first."""
    toks = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            toks.add(tok.content)
    return sorted((t for t in toks if t), key=len, reverse=True)


def template_info(tokenizer) -> TemplateInfo:
    """Find the assistant header and end-of-turn token of the tokenizer's chat template by probing it."""
    user = [{"role": "user", "content": PROBE_USER}]
    without = _render(tokenizer, user, False)
    with_prompt = _render(tokenizer, user, True)
    if not with_prompt.startswith(without) or with_prompt == without:
        raise TemplateError("the chat template emits no assistant generation prompt (add_generation_prompt)")
    header = with_prompt[len(without):]
    full = _render(tokenizer, user + [{"role": "assistant", "content": PROBE_ANSWER}], False)
    at = full.find(PROBE_ANSWER)
    if at < 0:
        raise TemplateError("the chat template does not render assistant content verbatim")
    rest = full[at + len(PROBE_ANSWER):]
    for tok in special_token_strings(tokenizer):
        if rest.startswith(tok):
            return TemplateInfo(header=header, end_of_turn=tok)
    eos = tokenizer.eos_token
    if eos and eos in rest:
        return TemplateInfo(header=header, end_of_turn=eos)
    raise TemplateError(f"cannot find the end-of-turn token after an assistant turn (template renders {rest[:40]!r})")


def final_answer(content: str) -> str:
    """The part of an assistant message that every template renders verbatim (after any thinking block)."""
    return content.split("</think>")[-1].strip()


def segment_conversation(tokenizer, info: TemplateInfo, messages: list[dict]) -> list[tuple[str, bool]]:
    """Rendered conversation as [(text, is_assistant), ...]; TemplateError if turns cannot be located."""
    text = _render(tokenizer, messages, False)
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for msg in messages:
        if msg["role"] != "assistant":
            continue
        h = text.find(info.header, cursor)
        if h < 0:
            raise TemplateError("assistant header not found")
        start = h + len(info.header)
        e = text.find(info.end_of_turn, start)
        if e < 0:
            raise TemplateError("end-of-turn not found")
        end = e + len(info.end_of_turn)
        body = text[start:end]
        if final_answer(msg["content"]) not in body:
            raise TemplateError("assistant content not where the template should put it")
        segments.append((text[cursor:start], False))
        if msg.get("truncated"):
            # the answer was cut at a length limit, not ended by the model: the end-of-turn the template adds is
            # context, never a target (else the drafter learns to predict turn ends mid-answer)
            segments.append((body[: -len(info.end_of_turn)], True))
            segments.append((info.end_of_turn, False))
        else:
            segments.append((body, True))
        cursor = end
    if cursor < len(text):
        segments.append((text[cursor:], False))
    return segments


def tokenize_segments(tokenizer, convs_segments: list[list[tuple[str, bool]]], last_turn_only: bool = False):
    """Batch-tokenize segmented conversations -> list of (input_ids list[int], loss_mask list[int])."""
    flat = [s for segs in convs_segments for s, _ in segs]
    enc = tokenizer(flat, add_special_tokens=False)["input_ids"] if flat else []
    out, k = [], 0
    for segs in convs_segments:
        ids: list[int] = []
        mask: list[int] = []
        last_assistant = max((i for i, (_, a) in enumerate(segs) if a), default=-1)
        for i, (_, is_asst) in enumerate(segs):
            toks = enc[k]
            k += 1
            on = is_asst and (not last_turn_only or i == last_assistant)
            ids.extend(toks)
            mask.extend([1 if on else 0] * len(toks))
        out.append((ids, mask))
    return out


def thinking_kwargs(tokenizer, reasoning: str | None, flag: str = "--reasoning") -> dict:
    """The chat template's keyword for `reasoning` (keep | drop | None = the template's default): Qwen3's
    `enable_thinking`. A template without that switch cannot do what was asked: a one-line TemplateError."""
    if reasoning is None:
        return {}
    if "enable_thinking" not in (getattr(tokenizer, "chat_template", None) or ""):
        raise TemplateError(f"{flag} {reasoning}: this verifier's chat template has no thinking switch "
                            f"(enable_thinking), so there is no thinking to {reasoning}")
    return {"enable_thinking": reasoning == "keep"}


def encode_prompt(tokenizer, rec: dict, **template_kwargs) -> list[int]:
    """Token ids of a prompt record through the chat template (generation prompt appended); `template_kwargs`
    reach the template (e.g. `thinking_kwargs`)."""
    msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
    if msgs and msgs[-1].get("role") == "assistant":
        msgs = msgs[:-1]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **template_kwargs)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer) -> list[int]:
    """Tokens that end an answer: EOS and the chat template's end-of-turn token (e.g. <|im_end|>, <|eot_id|>)."""
    ids = {tokenizer.eos_token_id}
    if getattr(tokenizer, "chat_template", None):
        try:
            ids.add(tokenizer.convert_tokens_to_ids(template_info(tokenizer).end_of_turn))
        except TemplateError:
            pass
    return sorted(t for t in ids if t is not None)
