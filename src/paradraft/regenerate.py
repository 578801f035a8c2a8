"""`paradraft regenerate`: the verifier answers the user turns itself, so the drafter learns on-policy text.

Output: messages JSONL (`{"id", "messages"}`), the format `prepare` reads. Appends one line per finished
conversation; a rerun skips ids already present (resumable). `--endpoint` sends the same chat requests to any
OpenAI-compatible server (e.g. `vllm serve`) instead of running the local model.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from .config import RegenerateConfig
from .data.sources import Skip, content_text, read_source
from .data.template import encode_prompt, final_answer, stop_token_ids, thinking_kwargs
from .decode.engine import Engine, GenerationConfig, compile_wanted
from .errors import UserError
from .outputs import OutputError, check_writable, output_lock
from .utils import engine_dtype, resolve_device
from .verifier import load_tokenizer, load_verifier, resolve_verifier
from .vllm_driver import VllmEngine, VllmError, engine_args, find_vllm_python


class EndpointError(UserError, RuntimeError):
    """The OpenAI-compatible server refused or failed a request."""


class RegenerateError(UserError, RuntimeError):
    """Regeneration produced nothing usable."""


def _is_record(line: bytes) -> bool:
    try:
        rec = json.loads(line)
    except ValueError:
        return False
    return isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("messages"), list)


def done_ids(path: Path, writer: str | None = None) -> set[str]:
    """Ids already written. The file must be a regenerate output: complete lines that are {id, messages} records,
    plus at most a torn last line (no newline) left by a killed run, which is cut off. Any other file is refused
    (OutputError), never truncated; so is one whose records name another verifier than `writer` (answers of two
    models mixed in one file would not be on-policy data for either)."""
    if not path.is_file():
        return set()
    with open(path, "rb") as fh:
        data = fh.read()
    lines = data.splitlines(keepends=True)
    complete = [ln for ln in lines if ln.endswith(b"\n")]
    torn = lines[-1] if lines and not lines[-1].endswith(b"\n") else b""
    bad = next((n for n, ln in enumerate(complete, 1) if ln.strip() and not _is_record(ln)), None)
    if bad is not None or (torn and not complete):
        raise OutputError(f"--output {path}: exists and is not a regenerate output (line {bad or 1} is not an "
                          f"{{id, messages}} record); paradraft appends only to its own output: choose another "
                          f"--output")
    recs = [json.loads(ln) for ln in complete if ln.strip()]
    if writer is not None:
        others = sorted({str(r["verifier"]) for r in recs if "verifier" in r and not same_model(r["verifier"], writer)})
        if others:
            raise OutputError(f"--output {path}: holds answers written by verifier {others[0]!r}, not {writer!r}; "
                              f"answers of two models in one file are on-policy data for neither: choose another "
                              f"--output")
    if torn:
        with open(path, "r+b") as fh:
            fh.truncate(len(data) - len(torn))
    return {r["id"] for r in recs}


def same_model(a: str, b: str) -> bool:
    """Two spellings of one model (a path and the id it was saved from compare by their last part, as a drafter's
    recorded verifier does)."""
    return os.path.basename(str(a).rstrip("/")) == os.path.basename(str(b).rstrip("/"))


def writer_name(cfg: RegenerateConfig) -> str:
    """The model whose answers a run writes: the model asked at --endpoint, else --verifier."""
    return (cfg.model_name or cfg.verifier) if cfg.endpoint else cfg.verifier


def chat_endpoint(url: str, model: str, messages: list[dict], max_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, timeout: float = 300.0,
                  reasoning: str | None = None) -> tuple[str, bool]:
    """One chat completion from an OpenAI-compatible server -> (answer, cut at max_tokens). Anything but a JSON
    chat completion (an HTML page, a proxy's error, a reset connection, no reply within `timeout`) is an
    EndpointError naming the URL. An answer with no text (content "" or null) comes back as "": the caller does
    not write it. `reasoning` keep | drop is sent as the template's enable_thinking (vLLM's chat_template_kwargs);
    a server that returns the thinking apart (`reasoning_content`) gets it put back in front of the answer, as the
    template renders it, when kept."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": top_p, "seed": seed}
    if reasoning is not None:
        body["chat_template_kwargs"] = {"enable_thinking": reasoning == "keep"}
    req = urllib.request.Request(url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise EndpointError(f"--endpoint {url}: HTTP {e.code}: {_shown(e.read())}") from None
    except urllib.error.URLError as e:
        reason = "no answer within --timeout" if isinstance(e.reason, TimeoutError) else e.reason
        raise EndpointError(f"--endpoint {url}: {reason}") from None
    except TimeoutError:
        raise EndpointError(f"--endpoint {url}: no answer within --timeout {timeout:g} s") from None
    except (OSError, http.client.HTTPException) as e:  # a reset connection, a reply that is not HTTP
        raise EndpointError(f"--endpoint {url}: the connection failed ({type(e).__name__}: {e})") from None
    try:
        reply = json.loads(raw)
    except ValueError:
        raise EndpointError(f"--endpoint {url}: the reply is not JSON (it begins {_shown(raw)}); is this the "
                            f"server's /v1 URL?") from None
    try:
        choice = reply["choices"][0]
        content = choice["message"].get("content")
        thought = choice["message"].get("reasoning_content") or choice["message"].get("reasoning")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise EndpointError(f"--endpoint {url}: not a chat completion: {_shown(raw)}") from None
    text = content_text(content) if content is not None else ""
    if text is None:
        raise EndpointError(f"--endpoint {url}: the answer's content is neither text nor text parts: {_shown(raw)}")
    if isinstance(thought, str) and thought.strip() and text.strip() and "</think>" not in text:
        text = f"<think>\n{thought.strip()}\n</think>\n\n{text}"
    return _reasoning_rule(text, reasoning), choice.get("finish_reason") == "length"


def _reasoning_rule(text: str, reasoning: str | None) -> str:
    """An answer as written: with --reasoning drop, any thinking block the verifier still wrote is left out."""
    return final_answer(text) if reasoning == "drop" else text


def answer_decoder(tok):
    """ids -> the answer's text: special tokens left out, except a thinking block's <think> / </think> (the chat
    template renders them inside the assistant turn, so training sees them). Built once per tokenizer."""
    vocab = tok.get_vocab()
    keep = {vocab[t] for t in ("<think>", "</think>") if t in vocab}
    if not keep:
        return lambda ids: tok.decode(ids, skip_special_tokens=True).strip()
    drop = set(tok.all_special_ids) - keep
    return lambda ids: tok.decode([t for t in ids if t not in drop], skip_special_tokens=False).strip()


def _shown(raw: bytes | str, n: int = 120) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = " ".join(text.split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def prompt_ids(tok, conversations: list[list[dict]], max_prompt_tokens: int,
               reasoning: str | None = None) -> list[list[int]]:
    """Token ids each engine generates from: the chat template with the generation prompt (and the thinking
    switch of --reasoning), the last `max_prompt_tokens` kept."""
    kw = thinking_kwargs(tok, reasoning)
    return [encode_prompt(tok, {"messages": m}, **kw)[-max_prompt_tokens:] for m in conversations]


class LocalGenerator:
    """Batched generation with the verifier itself, through paradraft's engine (greedy or sampled)."""

    def __init__(self, cfg: RegenerateConfig, model=None, tokenizer=None):
        device = resolve_device(cfg.device)
        if model is None:
            model, tokenizer = load_verifier(cfg.verifier, dtype=cfg.dtype, device=device)
        self.tok, self.cfg = tokenizer, cfg
        self.decode = answer_decoder(tokenizer)
        self.engine = Engine(model, max_len=cfg.max_prompt_tokens + cfg.max_new_tokens + 16,
                             compile=compile_wanted(cfg.compile, str(next(model.parameters()).device)))
        self.gcfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                     seed=cfg.seed, eos_token_ids=stop_token_ids(tokenizer))
        self.calls = 0
        if self.engine.compiled:  # its steps compile now, as vLLM's engine compiles when it starts: what the answers'
            # seconds and tokens/s measure is generation (compile_s says what compiling took). With --batch-size
            # rows: the step of a batch past the kernel's rows (linear.py) is another graph than one of 2 rows
            # (warmed with 2 rows, the first batch of 32 compiled its own, ~5 s inside the timed generation); a
            # smaller last batch or a call of one row compiles its own when it comes (counted in compile_s too)
            with torch.inference_mode():
                self.engine.generate([[1] * 4] * cfg.batch_size, GenerationConfig(max_new_tokens=2))

    @torch.inference_mode()
    def __call__(self, conversations: list[list[dict]]) -> list[tuple[str, bool]]:
        """Answers to conversations: (text, truncated = stopped by the length limit, not by a stop token)."""
        ids = prompt_ids(self.tok, conversations, self.cfg.max_prompt_tokens, self.cfg.reasoning)
        self.gcfg.seed = self.cfg.seed + self.calls
        self.calls += 1
        outs = self.engine.generate(ids, self.gcfg)
        return [(_reasoning_rule(self.decode(o.token_ids), self.cfg.reasoning),
                 o.finish_reason == "length") for o in outs]


class VllmGenerator:
    """The same prompts as LocalGenerator, generated by the verifier inside vLLM (offline, one batch per call;
    vLLM schedules the batch itself). `close()` ends the worker; its log stays beside --output if vLLM failed."""

    def __init__(self, cfg: RegenerateConfig, work_dir: Path):
        self.tok, self.cfg = load_tokenizer(cfg.verifier), cfg
        self.decode = answer_decoder(self.tok)
        self.eos = stop_token_ids(self.tok)
        self.work = Path(tempfile.mkdtemp(prefix=".paradraft-vllm-regenerate-", dir=work_dir))  # ours: removed at exit
        args = engine_args(resolve_verifier(cfg.verifier), cfg.dtype, seed=cfg.seed,
                           max_model_len=cfg.max_prompt_tokens + cfg.max_new_tokens + 16)
        self.engine = VllmEngine(args, "regenerate", self.work, cfg.vllm_python)
        self.calls, self.failed = 0, False

    def __call__(self, conversations: list[list[dict]]) -> list[tuple[str, bool]]:
        ids = prompt_ids(self.tok, conversations, self.cfg.max_prompt_tokens, self.cfg.reasoning)
        seeds = None
        if self.cfg.temperature > 0:  # one seed per request, different on every call
            seeds = [self.cfg.seed * 1_000_003 + self.calls * len(ids) + i for i in range(len(ids))]
        self.calls += 1
        try:
            r = self.engine.generate(ids, self.cfg.max_new_tokens, self.cfg.temperature, self.cfg.top_p, seeds=seeds,
                                     stop_token_ids=self.eos, batch_1=False)
        except VllmError:
            self.failed = True  # the error names the log: keep it
            raise
        return [(_reasoning_rule(self.decode(t), self.cfg.reasoning), f == "length")
                for t, f in zip(r["tokens"], r["finish"])]

    def close(self) -> None:
        self.engine.close()
        if not self.failed:
            shutil.rmtree(self.work, ignore_errors=True)


def regenerate(cfg: RegenerateConfig, generator=None) -> dict:
    """Run `regenerate`; returns counts."""
    out = Path(cfg.output)
    check_writable(out, "--output", is_dir=False)
    if cfg.engine == "paradraft" and not cfg.endpoint:  # paradraft's engine runs here: on which device (before work)
        cfg.device = resolve_device(cfg.device)
    cfg.dtype = engine_dtype(cfg.dtype, cfg.engine, cfg.device if cfg.device != "auto" else "cpu")
    if cfg.engine == "vllm" and generator is None:
        find_vllm_python(cfg.vllm_python)  # before the work: a missing vLLM is a one-line error
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and generator is None and cfg.engine == "paradraft":
        return _regenerate_ranks(cfg, out, rank, world)
    with output_lock(out, "--output"):  # two regenerate runs appending to one file would interleave
        result = _regenerate(cfg, out, generator)
    result.pop("order", None)
    return result


def _part(out: Path, rank: int, world: int) -> Path:
    return out.parent / f".{out.name}.rank{rank}-of-{world}.jsonl"


def _parts(out: Path) -> list[Path]:
    """The rank files of a torchrun regeneration into `out` (any world size: a killed run's are resumed)."""
    return sorted(out.parent.glob(f".{out.name}.rank*-of-*.jsonl"))


def _regenerate_ranks(cfg: RegenerateConfig, out: Path, rank: int, world: int) -> dict:
    """Under torchrun: rank r answers the conversations r, r + N, ... of the ones not yet written, into its own rank
    file beside --output; then rank 0 appends every answer to --output in the order one process writes them, so
    N processes write exactly the file one process writes (greedy; tested). Rank 0 holds --output's lock."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # the collectives here are barriers; each rank decodes on its own device
    part = _part(out, rank, world)
    with contextlib.ExitStack() as locks:
        locks.enter_context(output_lock(out if rank == 0 else part, "--output"))
        if rank == 0:
            locks.enter_context(output_lock(part, "--output"))
        result = _regenerate(cfg, out, None, share=(rank, world, part))
        dist.barrier()  # every rank file is complete
        if rank == 0:
            result = _merge_parts(cfg, out, result)
        dist.barrier()
    result.pop("order", None)
    return result


def _merge_parts(cfg: RegenerateConfig, out: Path, result: dict) -> dict:
    """Append the rank files' records to `out` in the order of `result["order"]` (then any others), fsync'd, and
    remove the rank files."""
    recs: dict[str, str] = {}
    for p in _parts(out):
        for line in p.read_text(encoding="utf-8").splitlines():
            if line.strip():
                recs.setdefault(json.loads(line)["id"], line)
    order = [i for i in result["order"] if i in recs] + sorted(set(recs) - set(result["order"]))
    with open(out, "a", encoding="utf-8") as fh:
        for i in order:
            fh.write(recs[i] + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    for p in _parts(out):
        p.unlink()
    print(f"[regenerate] {len(order)} answers of {int(os.environ.get('WORLD_SIZE', 1))} ranks -> {out}")
    return {**result, "written": len(order)}


def first_turn(messages: list[dict]) -> list[dict]:
    """A conversation's first user turn, with its system turn if it has one: the prompt of its first answer."""
    return [m for m in messages if m["role"] == "system"][:1] + [m for m in messages if m["role"] == "user"][:1]


def read_conversations(cfg: RegenerateConfig) -> tuple[list[dict], dict[str, int]]:
    """--data's usable conversations in regenerate's order (shuffled by --seed) and the skipped ones' counts by
    reason; none usable is a RegenerateError."""
    skipped: dict[str, int] = {}
    convs = []
    for spec in cfg.data:
        for item in read_source(spec):
            if isinstance(item, Skip):
                skipped[item.reason] = skipped.get(item.reason, 0) + 1
            else:
                convs.append(item)
    if not convs:
        raise RegenerateError(f"--data {' '.join(cfg.data)}: no usable conversation"
                              + (f"; skipped: {dict(sorted(skipped.items()))}" if skipped else ""))
    random.Random(cfg.seed).shuffle(convs)
    return convs, skipped


def fitting_conversations(cfg: RegenerateConfig, convs: list[dict], tok, skipped: dict[str, int]) -> list[dict]:
    """The first --max-samples of `convs` whose first turn fits --max-prompt-tokens (tok None: every one); the
    longer ones counted in `skipped`."""
    kept = []
    template_kw = thinking_kwargs(tok, cfg.reasoning) if tok is not None else {}
    for c in convs:
        if cfg.max_samples is not None and len(kept) >= cfg.max_samples:
            break
        n = len(encode_prompt(tok, {"messages": first_turn(c["messages"])}, **template_kw)) if tok is not None else 0
        if n > cfg.max_prompt_tokens:
            skipped["prompt_too_long"] = skipped.get("prompt_too_long", 0) + 1
            continue
        kept.append(c)
    return kept


def _regenerate(cfg: RegenerateConfig, out: Path, generator, share: tuple | None = None) -> dict:
    finished = done_ids(out, writer_name(cfg))
    for p in _parts(out) if share else []:  # answers a killed torchrun run left in rank files
        finished |= done_ids(p, writer_name(cfg))
    convs, skipped = read_conversations(cfg)
    # the first user turn (with any system turn) must fit --max-prompt-tokens: longer prompts are skipped, counted
    tok = getattr(generator, "tok", None)
    if tok is None:
        try:
            tok = load_tokenizer(cfg.verifier)
        except Exception as e:  # e.g. --endpoint serving a model whose tokenizer is not on this machine
            print(f"[regenerate] no tokenizer for {cfg.verifier!r} ({e}); prompts are not length-filtered")
    convs = fitting_conversations(cfg, convs, tok, skipped)
    todo = [c for c in convs if c["id"] not in finished]
    order = [c["id"] for c in todo]
    if share:  # this rank's share under torchrun, written to its own rank file
        rank, world, out = share
        todo = todo[rank::world]
    torch.manual_seed(cfg.seed)
    if generator is None:
        if cfg.endpoint:
            model = cfg.model_name or cfg.verifier
            pool = ThreadPoolExecutor(max_workers=max(1, cfg.batch_size))

            def generator(batch):
                return list(pool.map(lambda m: chat_endpoint(cfg.endpoint, model, m, cfg.max_new_tokens,
                                                             cfg.temperature, cfg.top_p, cfg.seed, cfg.timeout,
                                                             cfg.reasoning),
                                     batch))
        elif cfg.engine == "vllm":
            generator = VllmGenerator(cfg, out.resolve().parent)
        else:
            generator = LocalGenerator(cfg)
    try:
        return {**_write_answers(cfg, out, generator, todo, convs, skipped), "order": order}
    finally:
        if hasattr(generator, "close"):
            generator.close()


def _write_answers(cfg: RegenerateConfig, out: Path, generator, todo: list, convs: list, skipped: dict) -> dict:
    """Generate the answers of `todo` batch by batch, appending each finished batch to `out` (fsync'd)."""
    tok_count = getattr(getattr(generator, "tok", None), "encode", None)

    bar = tqdm(total=len(todo), desc="regenerate", unit=" conv", disable=None)
    t0, new_tokens, written, n_truncated, n_empty = time.time(), 0, 0, 0, 0
    writer = writer_name(cfg)
    with open(out, "a", encoding="utf-8") as fh:
        for b in range(0, len(todo), cfg.batch_size):
            batch = todo[b:b + cfg.batch_size]
            # keep the system turn and the first `max_turns` user turns; answers come from the verifier
            prefixes = []
            for c in batch:
                prefixes.append([m for m in c["messages"] if m["role"] == "system"][:1])
            users = [[m for m in c["messages"] if m["role"] == "user"][:cfg.max_turns] for c in batch]
            empty: set[int] = set()
            for turn in range(cfg.max_turns):
                active = [i for i in range(len(batch)) if turn < len(users[i])]
                if not active:
                    break
                for i in active:
                    prefixes[i].append(users[i][turn])
                answers = generator([prefixes[i] for i in active])
                for i, ans in zip(active, answers):
                    # a generator returns answers, or (answer, truncated) pairs
                    ans, truncated = (ans, False) if isinstance(ans, str) else ans
                    if not (ans or "").strip():  # no text is no answer: the conversation is not finished
                        empty.add(i)
                    msg = {"role": "assistant", "content": ans or ""}
                    if truncated:
                        msg["truncated"] = True
                        n_truncated += 1
                    prefixes[i].append(msg)
                    new_tokens += len(tok_count(ans)) if tok_count else len(ans.split())
            for i, (c, msgs) in enumerate(zip(batch, prefixes)):
                if i in empty:
                    n_empty += 1
                    continue
                fh.write(json.dumps({"id": c["id"], "messages": msgs, "verifier": writer},
                                    ensure_ascii=False) + "\n")
                written += 1
            fh.flush()
            os.fsync(fh.fileno())
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(1e-9, time.time() - t0):.1f}")
    bar.close()
    secs = time.time() - t0
    result = {"written": written, "already_done": len(convs) - len(todo), "skipped": skipped,
              "truncated": n_truncated, "empty_answers": n_empty, "new_tokens": new_tokens,
              "seconds": round(secs, 2),
              "new_tokens_per_s": round(new_tokens / secs, 1) if secs > 0 else None,
              "engine": "endpoint" if cfg.endpoint else cfg.engine}
    engine = getattr(generator, "engine", None)
    if getattr(engine, "compiled", False):
        result["compile_s"] = round(engine.compile_s, 2)
        print(f"[regenerate] compiling the engine's steps took {engine.compile_s:.1f} s, before the {secs:.0f} s of "
              "generation (torch.compile; --compile off skips it)")
    print(f"[regenerate] {written} new ({n_truncated} answers cut at --max-new-tokens, marked \"truncated\": their "
          f"end-of-turn is not trained), {result['already_done']} already done -> {out}")
    if n_empty:
        where = f"--endpoint {cfg.endpoint}" if cfg.endpoint else f"verifier {cfg.verifier}"
        msg = (f"{n_empty} conversation(s) got an empty answer from {where} and were not written (a rerun asks "
               f"again)")
        if not written:
            raise EndpointError(msg + "; no answer had any text") if cfg.endpoint else RegenerateError(msg)
        print(f"[regenerate] {msg}")
    return result
