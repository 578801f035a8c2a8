"""Typed configuration: one dataclass per command, filled by YAML then CLI flags (flags win), passed down whole."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import UserError

T = TypeVar("T")


def opt(default: Any = None, help: str = "", *, short: str | None = None, choices: list | None = None, factory=None,
        positional: bool = False, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None):
    """A config field with CLI help text; `factory` for mutable defaults; `positional` also takes it bare.

    ge / gt / le / lt: the range of a numeric field (each element of a list field), checked whenever a config is
    built, so a value out of range is refused with the flag's name before any work starts.
    """
    meta = {"help": help, "short": short, "choices": choices, "positional": positional,
            "range": {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class ConfigError(UserError, ValueError):
    """Bad configuration: an unknown key, a wrong type, a value out of range, a missing required value."""


_OPS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
        "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def flag_name(field: str) -> str:
    """The CLI flag of a config field."""
    return "--" + field.replace("_", "-")


def range_text(rng: dict) -> str:
    return " and ".join(f"{_OPS[k][0]} {v:g}" for k, v in rng.items())


class Checked:
    """Mixin of the command configs: every field's range and choices are checked when the config is built (from
    flags, YAML or code); `check()` adds the rules that tie fields together."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            rng = f.metadata.get("range") or {}
            choices = f.metadata.get("choices")
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if v is None:
                    continue
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{flag_name(f.name)} must be a finite number, got {v}")
                if isinstance(v, str) and not v.strip() and not f.metadata.get("may_be_empty"):
                    raise ConfigError(f"{flag_name(f.name)} is empty (an unset shell variable?); give a value or "
                                      f"leave the flag out")
                if choices and v not in choices:
                    raise ConfigError(f"{flag_name(f.name)} must be one of {', '.join(map(str, choices))}, got {v!r}")
                if rng and isinstance(v, (int, float)) and not isinstance(v, bool):
                    if any(not ok(v, rng[k]) for k, (_, ok) in _OPS.items() if k in rng) or v != v:
                        raise ConfigError(f"{flag_name(f.name)} must be {range_text(rng)}, got {v:g}")
        self.check()

    def check(self) -> None:
        """Rules between fields (override)."""


def _base_type(tp):
    """(base type, is_list) of a field annotation such as `int | None` or `list[str]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple):
        (inner,) = typing.get_args(tp)[:1] or (str,)
        return inner, True
    return tp, False


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one CLI flag per dataclass field (`--field-name`), all defaulting to None (= not given)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        base, is_list = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([f.metadata["short"]] if f.metadata.get("short") else [])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        help_text = f.metadata.get("help", "")
        if f.metadata.get("range"):
            help_text += f" ({range_text(f.metadata['range'])})"
        if default not in (None, [], ""):
            help_text += f" (default: {default})"
        help_text = help_text.replace("%", "%%")  # argparse formats help strings
        kw: dict[str, Any] = dict(dest=f.name, default=None, help=help_text)
        if f.metadata.get("choices"):
            kw["choices"] = f.metadata["choices"]
        if base is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
        elif is_list:
            parser.add_argument(*names, action="append", type=str, **kw)
        else:
            parser.add_argument(*names, type=base if base in (int, float) else str, **kw)
        if f.metadata.get("positional"):
            parser.add_argument(f"_pos_{f.name}", nargs="?", default=None, metavar=f.name.upper(),
                                help=f"same as --{f.name.replace('_', '-')}")
    parser.add_argument("--config", dest="_config_file", default=None,
                        help="YAML file with the same keys as the flags (underscores or dashes); flags win")


def _coerce(name: str, value: Any, tp) -> Any:
    """A flag's or YAML key's value as its field's type. Strict: YAML `2.7` or `true` is not an int, `1` is not a
    bool, a list is not a scalar; strings (from the command line) are parsed exactly."""
    base, is_list = _base_type(tp)
    if value is None:
        return None
    if is_list:
        if not isinstance(value, (list, tuple)):
            value = [value]
        if base in (int, float):  # "3,5,7" or ["3,5", "7"] -> [3, 5, 7]
            value = [p for v in value for p in (v.split(",") if isinstance(v, str) else [v])
                     if not (isinstance(p, str) and p.strip() == "")]
        return [_coerce(name, v, base) for v in value]

    def wrong() -> ConfigError:
        shown = type(value).__name__ if isinstance(value, (dict, list, tuple)) else repr(value)
        return ConfigError(f"{flag_name(name)} (config key '{name}'): expected {_type_words(base)}, got {shown}")

    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "false", "no", "off"):
            return value.strip().lower() in ("true", "yes", "on")
        raise wrong()
    if base in (int, float):  # an int for a float field, never a float (2.7) or a bool for an int field
        if isinstance(value, (int, float) if base is float else int) and not isinstance(value, bool):
            return base(value)
        if isinstance(value, str):
            try:
                return base(value.strip())
            except ValueError:
                raise wrong() from None
        raise wrong()
    if base is str:
        if isinstance(value, str):
            return value
        raise wrong()
    return value


def _type_words(base) -> str:
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(
        base, getattr(base, "__name__", str(base)))


def _unknown_key(key, names: set[str], where: str) -> str:
    """One line naming an unknown config key: its closest known spelling, or every known key."""
    close = difflib.get_close_matches(str(key).replace("-", "_"), sorted(names), n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(sorted(names))}"
    return f"unknown key '{key}' {where}; {hint}"


def build_config(cls: type[T], yaml_path: str | Path | None = None, overrides: dict | None = None) -> T:
    """Dataclass defaults <- YAML file <- overrides (non-None values only); an unknown key in either is an error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if yaml_path:
        path = Path(yaml_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"--config {path}: " + ("is a directory, not a YAML file" if path.is_dir()
                                                      else "no such file"))
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8-sig")) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"--config {path}: not a text file (not UTF-8)") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            raise ConfigError(f"--config {path}: not valid YAML{at} ({getattr(e, 'problem', None) or e})") from None
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: must hold a mapping of keys to values, not a "
                              f"{type(loaded).__name__}")
        for k, v in loaded.items():
            key = str(k).replace("-", "_")
            if key not in names:
                raise ConfigError(_unknown_key(k, names, f"in {path}"))
            values[key] = _coerce(key, v, hints[key])
    overrides = overrides or {}
    for k in overrides:  # one rule for recipes and library callers too: a misspelt key never vanishes silently
        if k not in names:
            raise ConfigError(_unknown_key(k, names, f"for {cls.__name__}"))
    for k, v in overrides.items():
        if v is not None:
            values[k] = _coerce(k, v, hints[k])
    try:
        return cls(**values)
    except TypeError as e:  # a required value left out
        raise ConfigError(f"{cls.__name__}: {e}") from None


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """Build a config from parsed CLI args (see `add_config_args`)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}  # the namespace also holds the CLI's own names
    for k, v in vars(args).items():
        if k.startswith("_pos_") and v is not None:
            values[k[5:]] = v
    return build_config(cls, getattr(args, "_config_file", None), values)


def field_defaults(cls) -> dict:
    """{field: default} of a config dataclass (fields without a plain default left out)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def config_to_dict(cfg) -> dict:
    """Plain dict of a config dataclass (for manifests and saved configs)."""
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------------- commands

DEFAULT_VERIFIER = "smollm2-135m"
DEVICE_HELP = ("auto | cpu | cuda | cuda:N (auto: the GPU when torch sees one, cuda:LOCAL_RANK under torchrun; "
               "else the CPU)")
COMPILE_HELP = ("compile paradraft's engine's decoding steps with torch.compile (auto: on a CPU, for runs of 2048 new "
                "tokens or more; ~25 s the first time on a host, ~4 s after)")


@dataclasses.dataclass
class PrepareConfig(Checked):
    """`paradraft prepare`: chat data -> tokenized samples with the assistant loss mask."""

    data: list[str] = opt(factory=lambda: ["sharegpt"], help="data source (repeatable): sharegpt | humaneval | "
                          "chitchat | FILE.json[l] (ShareGPT or messages) | DIR saved by datasets.save_to_disk")
    output: str = opt("runs/data", help="output directory", short="-o")
    verifier: str = opt(DEFAULT_VERIFIER, help="verifier whose tokenizer and chat template are used")
    seq_length: int = opt(2048, help="the most tokens of a sample (see --long-conversations)", ge=2)
    long_conversations: str = opt("truncate", help="a conversation longer than --seq-length: truncate (keep its "
                                  "first --seq-length tokens) or split (at turn boundaries, into several samples, "
                                  "each with as much preceding context as fits; every assistant token trained "
                                  "once)", choices=["truncate", "split"])
    join_parts: bool = opt(False, help="first reassemble conversations stored in parts whose ids share a prefix "
                           "(the packaged ShareGPT's `abc_0`, `abc_1`, ...), in the order of their suffixes")
    max_samples: int | None = opt(None, help="keep at most this many samples (after the seeded shuffle)", ge=1)
    seed: int = opt(0, help="seed of the deterministic shuffle")
    val_fraction: float = opt(0.02, help="held-out fraction for validation and benchmarks", ge=0, lt=1)
    last_turn_only: bool = opt(False, help="train only on the last assistant turn")
    chat_template: str | None = opt(None, help="Jinja chat template file, for tokenizers without one")
    preview: int = opt(0, help="print N samples with the trained (loss-masked) text highlighted", ge=0)
    overwrite: bool = opt(False, help="replace a dataset this command wrote before in --output (never other files)")

    def check(self) -> None:
        if not self.data:
            raise ConfigError("--data: give at least one source")


# what `auto` means for every dtype flag (the rule: paradraft.utils.fast_dtype)
AUTO_DTYPE = ("auto: bfloat16 on a GPU that has it or a CPU with AMX, else float32, where bf16 is the slow path "
              "(5-6x slower on an AVX2 CPU)")
VLLM_PYTHON_HELP = ("with --engine vllm: the Python that has vLLM (default: $PARADRAFT_VLLM_PYTHON, else "
                    ".venv-vllm/bin/python, else this Python)")


@dataclasses.dataclass
class RegenerateConfig(Checked):
    """`paradraft regenerate`: the verifier writes fresh answers to the user turns (on-policy data)."""

    data: list[str] = opt(factory=lambda: ["sharegpt"], help="data source (repeatable), as for prepare")
    output: str = opt("runs/regenerated.jsonl", help="output messages JSONL (appended; rerun resumes)", short="-o")
    verifier: str = opt(DEFAULT_VERIFIER, help="verifier that writes the answers")
    endpoint: str | None = opt(None, help="OpenAI-compatible server URL (e.g. vLLM http://host:8000/v1) "
                               "instead of the local model")
    model_name: str | None = opt(None, help="model name sent to --endpoint (default: the verifier name)")
    max_samples: int | None = opt(None, help="regenerate at most this many conversations (after the shuffle)", ge=1)
    max_turns: int = opt(1, help="regenerate the first N user turns of each conversation", ge=1)
    max_new_tokens: int = opt(256, help="longest answer per turn", ge=1)
    reasoning: str | None = opt(None, help="for chat templates with a thinking block (Qwen3's enable_thinking): "
                                "keep = the verifier thinks and its thinking is written into each answer (and "
                                "trained); drop = it answers without thinking (default: the template's own)",
                                choices=["keep", "drop"])
    max_prompt_tokens: int = opt(1024, help="skip conversations whose prompt is longer", ge=1)
    temperature: float = opt(0.0, help="0 = greedy", ge=0)
    top_p: float = opt(1.0, help="nucleus sampling", gt=0, le=1)
    batch_size: int = opt(8, help="conversations generated together", ge=1)
    seed: int = opt(0, help="seed of the shuffle and of sampling")
    dtype: str = opt("auto", help=f"verifier dtype ({AUTO_DTYPE})", choices=["auto", "bfloat16", "float32"])
    timeout: float = opt(300.0, help="HTTP timeout per request with --endpoint (seconds)", gt=0)
    engine: str = opt("paradraft", help="generate with paradraft's engine, or with vLLM offline (batched; "
                      "--batch-size conversations per request batch)", choices=["paradraft", "vllm"])
    vllm_python: str | None = opt(None, help=VLLM_PYTHON_HELP)
    device: str = opt("auto", help=DEVICE_HELP)
    compile: str = opt("auto", help=COMPILE_HELP, choices=["auto", "on", "off"])

    def check(self) -> None:
        check_device_name(self.device)
        if self.endpoint is not None and not re.match(r"^https?://[^/\s]+", self.endpoint):
            raise ConfigError(f"--endpoint {self.endpoint!r}: give the server's URL, e.g. http://localhost:8000/v1")
        if self.endpoint and self.engine != "paradraft":
            raise ConfigError("--endpoint sends requests to a server; --engine chooses a local engine: give one")


@dataclasses.dataclass
class VocabConfig(Checked):
    """`paradraft vocab`: draft vocabulary (d2t, t2d) from the token frequencies of prepared data."""

    data: list[str] = opt(factory=lambda: ["runs/data"], help="prepared data directory (repeatable, counts add up)")
    output: str = opt("runs/vocab.safetensors", help="output file (.safetensors; a .json summary is written beside)",
                      short="-o")
    size: int = opt(8192, help="draft vocabulary size", ge=1)
    fill: bool = opt(False, help="pad with the next ids in tokenizer order when fewer tokens were seen")
    verifier: str | None = opt(None, help="verifier (default: the one the data was prepared for)")

    def check(self) -> None:
        if not self.output.endswith(".safetensors"):
            raise ConfigError(f"--output {self.output}: the vocabulary file must end in .safetensors")
        if not self.data:
            raise ConfigError("--data: give at least one prepared data directory")


@dataclasses.dataclass
class ExtractConfig(Checked):
    """`paradraft extract`: verifier aux hidden states + last hidden state of every prepared sample -> shards."""

    data: str = opt("runs/data", help="prepared data directory")
    output: str = opt("runs/hidden_states", help="output directory", short="-o")
    verifier: str | None = opt(None, help="verifier (default: the one the data was prepared for)")
    layers: list[int] | None = opt(None, help="the 3 aux layer ids, comma separated (default 2,L//2,L-3)", ge=0)
    split: str = opt("all", help="which samples", choices=["all", "train", "val"])
    dtype: str = opt("auto", help="verifier and storage dtype; auto: the verifier runs in bfloat16 on a GPU that "
                     "has it or a CPU with AMX, else in float32, and the hidden states are stored in bfloat16",
                     choices=["auto", "bfloat16", "float32"])
    batch_tokens: int = opt(8192, help="tokens per verifier batch (padded)", ge=1)
    samples_per_shard: int = opt(256, help="samples per shard file", ge=1)
    shard: str | None = opt(None, help="K/N: this process does shards K, K+N, ... (default: torchrun RANK/WORLD_SIZE)")
    trained_only: bool = opt(False, help="store only the positions training reads (drop the tail after the last "
                             "trained token, and last hidden states that are never a target)")
    validate: bool = opt(False, help="re-read and check every shard of --output, then exit")
    overwrite: bool = opt(False, help="replace hidden states of another extraction in --output (only the files "
                          "extract wrote)")
    max_samples: int | None = opt(None, help="extract at most this many samples", ge=1)
    device: str = opt("auto", help=DEVICE_HELP)
    engine: str = opt("hf", help="run the verifier with Hugging Face transformers, or inside vLLM (its "
                      "extract_hidden_states method; needs a GPU build of vLLM)", choices=["hf", "vllm"])
    vllm_python: str | None = opt(None, help=VLLM_PYTHON_HELP)

    def check(self) -> None:
        check_device_name(self.device)
        if self.layers is not None:
            check_aux_layers(self.layers, "--layers")
        if self.shard is not None:
            parse_shard(self.shard)


def check_device_name(name: str, flag: str = "--device") -> None:
    """A device flag's spelling (whether the device exists is utils.resolve_device's question, asked at run time)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ConfigError(f"{flag} {name!r}: give auto, cpu, cuda or cuda:N")


def check_aux_layers(layers: list[int], flag: str) -> None:
    """EAGLE-3 and P-EAGLE read exactly three distinct verifier layers (vLLM's fc is 3H -> H)."""
    if len(layers) != 3 or len(set(layers)) != 3:
        raise ConfigError(f"{flag} needs 3 distinct layer ids (the drafter reads 3 verifier layers), got "
                          f"{','.join(map(str, layers))}")


def parse_shard(spec: str) -> tuple[int, int]:
    """'K/N' -> (K, N) with 0 <= K < N."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ConfigError(f"--shard must look like K/N, got {spec!r}") from None
    if not 0 <= k < n:
        raise ConfigError(f"--shard K/N needs 0 <= K < N, got {spec}")
    return k, n


# flags that may change when a run is resumed: how long it runs, how often it saves, logs and validates, where
# its files are (the data's identity is checked separately). Everything else must equal the checkpoint's.
RESUME_MAY_CHANGE = ("resume", "overwrite", "max_steps", "epochs", "save_every", "time_limit", "keep_checkpoints",
                     "log_every", "val_every", "val_samples", "device", "attention", "partition_tokens", "output",
                     "data", "hidden_states")


@dataclasses.dataclass
class TrainConfig(Checked):
    """`paradraft train`: train a P-EAGLE or EAGLE-3 drafter."""

    algorithm: str = opt("peagle", help="drafter algorithm: a registered one (peagle, eagle3; see "
                         "paradraft.models.registry)")
    verifier: str | None = opt(None, help="verifier (default: the one the data was prepared for)")
    data: str = opt("runs/data", help="prepared data directory")
    hidden_states: str | None = opt(None, help="extracted hidden states directory (offline mode)")
    online: bool = opt(False, help="compute hidden states with the verifier inside training (nothing on disk)")
    output: str = opt("runs/drafter", help="output directory: final checkpoint, metrics.jsonl, plot", short="-o")
    vocab: str | None = opt(None, help="draft vocabulary file from `paradraft vocab` (default: built from --data)")
    draft_vocab_size: int = opt(8192, help="draft vocabulary size when --vocab is not given", ge=1)
    num_layers: int = opt(1, help="draft decoder layers", ge=1)
    draft_layer: str | None = opt(None, help="draft decoder layer style: auto follows the verifier's family; qwen3 "
                                  "adds per-head q/k RMSNorm whatever the verifier (speculators' P-EAGLE layer; vLLM "
                                  "serves it for any verifier), llama leaves it out (default: the algorithm's: qwen3 "
                                  "for P-EAGLE, auto for EAGLE-3)", choices=["auto", "llama", "qwen3"])
    norm_before_residual: bool | None = opt(None, help="the first layer's residual is the normalized hidden "
                                            "state (default: the algorithm's: on for P-EAGLE, off for EAGLE-3)")
    num_depths: int = opt(8, help="P-EAGLE prediction depths trained (K drafted in one pass <= this)", ge=1)
    cod_ratio: float = opt(0.7, help="P-EAGLE COD keep ratio per depth", gt=0, le=1)
    cod_ratio_min: float = opt(0.2, help="P-EAGLE COD floor", gt=0, le=1)
    ttt_steps: int = opt(3, help="EAGLE-3 training-time-test unroll steps", ge=1)
    loss_decay: float | None = opt(None, help="depth d (P-EAGLE) / TTT step d (EAGLE-3) weighted decay^d in the "
                                   "loss (default: 0.3 P-EAGLE, 0.8 EAGLE-3; 1 weights every depth equally)",
                                   gt=0)
    train_out_of_vocab: bool = opt(False, help="also train the positions whose verifier argmax lies outside the draft "
                                   "vocabulary, on the verifier's distribution renormalized over the draft vocabulary "
                                   "(the reference trainer's loss); default: no loss there, as the drafter can never "
                                   "propose that token")
    init_norm: str = opt("ones", help="drafter final norm starts as ones or as the verifier's final norm (measured "
                         "equal on the embedded verifier)", choices=["ones", "verifier"])
    mask_hidden_init: str = opt("normal", help="P-EAGLE: mask_hidden starts as N(0, 0.02) noise, as zeros (then "
                                "the depth >= 1 elements' residual starts empty and their attention output carries "
                                "what they predict) or as N(0, 1) (`unit`, speculators' init)",
                                choices=["normal", "zero", "unit"])
    init_std: float | None = opt(None, help="the drafter's fc and draft-layer weight matrices start as N(0, "
                                 "init_std) (the reference trainer's init: its verifier's initializer_range, 0.02 "
                                 "for SmolLM2); default: torch's Linear init (uniform, std 1/sqrt(3 fan_in), "
                                 "0.014-0.024 here)", gt=0)
    train_embeddings: bool = opt(False, help="train the drafter's copy of the verifier's token embeddings too "
                                 "(default: frozen, only P-EAGLE's mask row trains; exported either way)")
    freeze_lm_head: bool = opt(False, help="keep the drafter's lm_head at the verifier's draft-vocabulary rows "
                               "(speculators' default; 4.7M fewer trained weights for SmolLM2 at an 8k draft vocab)")
    num_speculative_tokens: int | None = opt(None, help="K recorded in the checkpoint (default: the algorithm's: "
                                             "7, and at most --num-depths for P-EAGLE)", ge=1)
    optimizer: str | None = opt(None, help="adamw: AdamW (0.9, --adam-beta2) over every trained weight; muon: "
                                "torch's Muon (orthogonalised momentum, its update scaled to AdamW's RMS) over the "
                                "draft layers' weight matrices and AdamW over the rest (embeddings, lm_head, norms, "
                                "P-EAGLE's mask parameters), speculators' default (default: the algorithm's: muon "
                                "for P-EAGLE, adamw for EAGLE-3)", choices=["adamw", "muon"])
    lr: float = opt(1e-3, help="peak learning rate (AdamW; 1e-3 measured best on the embedded verifier; above 10 "
                    "every optimizer diverges)", gt=0, le=10)
    muon_lr: float | None = opt(None, help="--optimizer muon: peak learning rate of the Muon group (default: --lr; "
                                "its update RMS matches AdamW's, so the same rate applies)", gt=0, le=10)
    weight_decay: float | None = opt(None, help="AdamW weight decay (default: the algorithm's: 0.01 P-EAGLE, 0 "
                                     "EAGLE-3)", ge=0)
    adam_beta2: float | None = opt(None, help="AdamW's second-moment decay (beta2; the reference trainer keeps "
                                   "torch's 0.999) (default: the algorithm's: 0.999 P-EAGLE, 0.95 EAGLE-3)", gt=0,
                                   lt=1)
    muon_weight_decay: float = opt(0.1, help="--optimizer muon: decoupled weight decay of the Muon group", ge=0)
    warmup_steps: int | None = opt(None, help="linear warmup steps, then --lr-schedule (default: the algorithm's: "
                                   "1 P-EAGLE, 20 EAGLE-3)", ge=0)
    lr_schedule: str | None = opt(None, help="after warmup: cosine decay to 10% of --lr, linear decay to 0, or "
                                  "constant (default: the algorithm's: linear P-EAGLE, cosine EAGLE-3)",
                                  choices=["cosine", "linear", "constant"])
    hidden_noise: float = opt(0.0, help="training only: add Gaussian noise of this std, relative to each verifier "
                              "hidden state's RMS, to the drafter's hidden-state inputs (a regulariser)", ge=0)
    max_grad_norm: float = opt(1.0, help="gradient clipping", gt=0)
    batch_tokens: int = opt(4096, help="slots per packed sequence (samples are packed with document ids)", ge=2)
    partition_tokens: int | None = opt(None, help="sequence partitioning: a packed sequence of more slots than this "
                                       "(a long sample) trains in partitions of this many anchors, one after another, "
                                       "with the gradients of one step: peak memory is set by the partition, not the "
                                       "sample (default: --batch-tokens)", ge=8)
    grad_accum: int = opt(1, help="packed sequences per optimizer step (per process)", ge=1)
    epochs: int = opt(2, help="passes over the training split (a second pass over 710k tokens gained as much as "
                      "twice the data: BENCHMARKS.md)", ge=1)
    max_steps: int | None = opt(None, help="stop after this many optimizer steps (overrides --epochs; epochs cycle)",
                                ge=1)
    save_every: int = opt(100, help="checkpoint every N steps", ge=1)
    time_limit: float | None = opt(None, help="minutes of training in this process: at the first step that would end "
                                   "past them, save a checkpoint and stop, paused (exit 75); the same command with "
                                   "--resume continues (a run longer than one session)", gt=0)
    keep_checkpoints: int = opt(2, help="how many step checkpoints to keep", ge=1)
    val_every: int = opt(0, help="validate every N steps (0 = only at the end)", ge=0)
    val_samples: int = opt(64, help="validation samples (held-out split)", ge=0)
    log_every: int = opt(1, help="metrics.jsonl every N steps", ge=1)
    seed: int = opt(0, help="seed (data order, COD sampling, init)")
    resume: bool = opt(False, help="continue from the last checkpoint in --output (the flags must match it)")
    overwrite: bool = opt(False, help="replace a training run this command wrote before in --output (its own files "
                          "only)")
    autocast: str = opt("auto", help="autocast dtype (weights stay float32); auto: bfloat16 on a GPU that has it or a "
                        "CPU with AMX, else float32 (without AMX, CPU bf16 matmuls are slower than float32)",
                        choices=["auto", "bfloat16", "float32"])
    attention: str = opt("auto", help="attention backend: sdpa (dense mask), flex (GPU), auto",
                         choices=["auto", "sdpa", "flex"])
    fsdp: bool = opt(False, help="shard the drafter with FSDP (torchrun, large drafters on GPUs)")
    device: str = opt("auto", help=DEVICE_HELP)
    verifier_dtype: str = opt("auto", help=f"verifier dtype (online mode and targets; {AUTO_DTYPE}; a "
                              "resumed run keeps the dtype it began with)", choices=["auto", "bfloat16", "float32"])

    def check(self) -> None:
        check_device_name(self.device)
        if (self.hidden_states is None) == (not self.online):
            raise ConfigError("give --hidden-states DIR (offline) or --online, not both" if self.online
                              else "give --hidden-states DIR (offline) or --online")
        if self.resume and self.overwrite:
            raise ConfigError("--resume continues the run in --output, --overwrite replaces it: give one")


@dataclasses.dataclass
class GenerateConfig(Checked):
    """`paradraft generate`: speculative decoding (or plain decoding without --drafter)."""

    verifier: str = opt(DEFAULT_VERIFIER, help="verifier")
    drafter: str | None = opt(None, help="drafter checkpoint directory (none = plain decoding, the baseline)")
    prompt: str | None = opt(None, help="one user turn (wrapped by the chat template)")
    prompts: str | None = opt(None, help="JSONL file: {id, prompt} or {id, messages} per line")
    output: str | None = opt(None, help="output JSONL (default: print a summary)", short="-o")
    max_new_tokens: int = opt(256, help="longest answer", ge=1)
    temperature: float = opt(0.0, help="0 = greedy", ge=0)
    top_p: float = opt(1.0, help="nucleus sampling", gt=0, le=1)
    top_k: int = opt(0, help="top-k sampling (0 = off)", ge=0)
    num_speculative_tokens: int | None = opt(None, help="K draft tokens per verifier pass (default: the K the drafter "
                                             "records in its config.json, which train sets within the depths it "
                                             "trained)", ge=1)
    batch_size: int = opt(1, help="prompts decoded together", ge=1)
    dtype: str = opt("auto", help=f"verifier and drafter dtype ({AUTO_DTYPE})", choices=["auto", "bfloat16", "float32"])
    seed: int = opt(0, help="sampling seed")
    stream: bool = opt(False, help="print text as it is accepted (batch size 1)")
    force: bool = opt(False, help="use a drafter recorded for another verifier")
    max_len: int = opt(4096, help="KV cache length per sequence", ge=2)
    device: str = opt("auto", help=DEVICE_HELP)
    compile: str = opt("auto", help=COMPILE_HELP, choices=["auto", "on", "off"])

    def check(self) -> None:
        check_device_name(self.device)
        if (self.prompt is None) == (self.prompts is None):
            raise ConfigError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")


@dataclasses.dataclass
class BenchConfig(Checked):
    """`paradraft bench`: acceptance length, per-position acceptance, tokens/s and speedup, side by side."""

    verifier: str = opt(DEFAULT_VERIFIER, help="verifier")
    drafter: list[str] = opt(factory=list, help="drafter checkpoint (repeatable)")
    dataset: str = opt("sharegpt-val",
                       help="sharegpt-val (held-out split of --data) | humaneval | FILE.jsonl (prompts)")
    data: str = opt("runs/quickstart/data", help="prepared data whose validation split is sharegpt-val")
    val_context: str = opt("first", help="with sharegpt-val: prompt with each held-out sample up to its first "
                           "assistant turn, or up to its last (the whole multi-turn context, its last tokens where it "
                           "would not fit the verifier's context beside the answer: long prompts)",
                           choices=["first", "last"])
    num_prompts: int = opt(8, help="prompts", ge=1)
    max_new_tokens: int = opt(128, help="tokens per answer", ge=1)
    temperature: float = opt(0.0, help="0 = greedy", ge=0)
    top_p: float = opt(1.0, help="nucleus sampling", gt=0, le=1)
    num_speculative_tokens: list[int] = opt(factory=list, help="K values, comma separated (default: the K each "
                                            "drafter records in its config.json; 3 for prompt lookup alone)", ge=1)
    repeats: int = opt(2, help="repeats (interleaved); tokens/s is the median", ge=1)
    prompt_lookup: bool = opt(True, help="also run Hugging Face assisted generation with prompt lookup")
    dtype: str = opt("auto", help=f"verifier and drafter dtype ({AUTO_DTYPE}, on the engine's device)",
                     choices=["auto", "bfloat16", "float32"])
    output: str = opt("runs/bench/results.json", help="output JSON", short="-o")
    plot: str | None = opt(None, help="PNG of speedup and acceptance length against K")
    seed: int = opt(0, help="sampling seed")
    force: bool = opt(False, help="use drafters recorded for another verifier")
    reuse: bool = opt(False, help="show the results in --output instead of measuring again when they are of this "
                      "exact benchmark (same flags, prompts and drafter weights)")
    engine: str = opt("paradraft", help="decode with paradraft's engine, or inside vLLM (acceptance from vLLM's "
                      "counters; prompt lookup is vLLM's ngram method)", choices=["paradraft", "vllm"])
    vllm_python: str | None = opt(None, help=VLLM_PYTHON_HELP)
    device: str = opt("auto", help=DEVICE_HELP + "; paradraft's engine (vLLM picks its own)")
    compile: str = opt("auto", help=COMPILE_HELP + "; compiled before timing", choices=["auto", "on", "off"])

    def check(self) -> None:
        check_device_name(self.device)


@dataclasses.dataclass
class ExportConfig(Checked):
    """`paradraft export`: write (or validate and convert) a drafter checkpoint that vLLM serves."""

    drafter: str | None = opt(None, help="drafter checkpoint directory (paradraft, speculators or original EAGLE-3)",
                              positional=True)
    output: str | None = opt(None, help="output directory (new, empty, or an earlier export)", short="-o")
    verifier: str | None = opt(None, help="verifier (default: the one recorded in the drafter)")
    dtype: str = opt("bfloat16", help="weights dtype", choices=["bfloat16", "float32"])
    num_speculative_tokens: int | None = opt(None, help="K recorded in config.json and in the serve command "
                                             "(default: the smallest K within 0.01 tokens per pass of the best "
                                             "held-out acceptance estimate train recorded, else the drafter's own "
                                             "K)", ge=1)
    force: bool = opt(False, help="export a drafter recorded for another verifier")

    def check(self) -> None:
        if not self.drafter or not self.output:
            raise ConfigError("usage: paradraft export DRAFTER --output OUT")


@dataclasses.dataclass
class QuickstartConfig(Checked):
    """`paradraft quickstart`: the whole workflow on the embedded verifier, artifacts under --output."""

    output: str = opt("runs/quickstart", help="run directory", short="-o")
    verifier: str = opt(DEFAULT_VERIFIER, help="verifier")
    data: list[str] = opt(factory=lambda: ["sharegpt"], help="data source (repeatable)")
    num_samples: int = opt(192, help="conversations regenerated by the verifier", ge=2)
    max_new_tokens: int = opt(160, help="longest regenerated answer", ge=1)
    max_prompt_tokens: int = opt(256, help="skip longer prompts when regenerating", ge=1)
    regen_batch_size: int = opt(32, help="conversations generated together", ge=1)
    seq_length: int = opt(512, help="tokens per training sample", ge=2)
    draft_vocab_size: int = opt(8192, help="draft vocabulary size", ge=1)
    max_steps: int = opt(120, help="training steps", ge=1)
    num_depths: int | None = opt(None, help="P-EAGLE prediction depths trained (default: the largest K benchmarked; "
                                 "depths no draft reads cost training time and score no higher)", ge=1)
    bench_prompts: int = opt(6, help="held-out prompts benchmarked", ge=1)
    bench_tokens: int = opt(96, help="new tokens per benchmark prompt", ge=1)
    bench_repeats: int = opt(3, help="benchmark repeats, plain and speculative interleaved; speeds are medians",
                             ge=1)
    num_speculative_tokens: list[int] = opt(factory=lambda: [3], help="K values benchmarked (the drafter records the "
                                            "largest for serving)", ge=1)
    seed: int = opt(0, help="seed")
    device: str = opt("auto", help=DEVICE_HELP)
    compile: str = opt("auto", help=COMPILE_HELP + " (regenerate and bench)", choices=["auto", "on", "off"])

    def check(self) -> None:
        check_device_name(self.device)
        if not self.num_speculative_tokens or max(self.num_speculative_tokens) > self.depths():
            raise ConfigError(f"--num-speculative-tokens {self.num_speculative_tokens}: each K must be <= "
                              f"--num-depths {self.depths()}")

    def depths(self) -> int:
        """The P-EAGLE depths trained: --num-depths, or the largest K benchmarked."""
        return self.num_depths or max(self.num_speculative_tokens, default=1)
