"""The `paradraft` command line: one entry point for the whole workflow."""

from __future__ import annotations

import argparse
import os
import sys

from . import config as C

WORKFLOW = """\
P-EAGLE parallel drafting for lossless speculative decoding.

workflow (each step reads what the previous one wrote):
  prepare      chat data -> tokens + assistant loss mask        (ShareGPT, messages JSONL, datasets dir, built-ins)
  regenerate   the verifier rewrites the answers (on-policy data; local model or an OpenAI-compatible --endpoint)
  vocab        draft vocabulary d2t / t2d from the trained-token frequencies
  extract      verifier aux hidden states (3 layers) + last hidden state -> safetensors shards (resumable, --shard K/N)
  train        P-EAGLE (depths + COD + parallel mask) or EAGLE-3 (training-time test); --online or --hidden-states
  generate     lossless speculative decoding (greedy or sampled, batched); no --drafter = plain decoding
  bench        acceptance length, per-position acceptance, tokens/s, speedup, plot; plain / drafters / prompt lookup
  export       the vLLM / speculators checkpoint (also converts original EAGLE-3 layouts) + the serve command
  quickstart   the whole workflow on the embedded SmolLM2-135M verifier (what `make demo` runs)

every command takes its flags from `--config FILE.yaml` too (same keys; flags win).
"""


class _Fmt(argparse.RawDescriptionHelpFormatter):
    pass


def _cmd_prepare(cfg: C.PrepareConfig) -> None:
    from .data.prepare import prepare

    prepare(cfg)


def _cmd_regenerate(cfg: C.RegenerateConfig) -> None:
    from .data.regenerate import regenerate

    regenerate(cfg)


def _cmd_vocab(cfg: C.VocabConfig) -> None:
    from .data.vocab import vocab

    vocab(cfg)


def _cmd_extract(cfg: C.ExtractConfig) -> None:
    from .data.hidden_states import extract

    extract(cfg)


def _cmd_train(cfg: C.TrainConfig) -> None:
    from .train.trainer import train

    train(cfg)


def _cmd_generate(cfg: C.GenerateConfig) -> None:
    from .decode.generate import generate

    generate(cfg)


def _cmd_bench(cfg: C.BenchConfig) -> None:
    from .bench.run import bench

    bench(cfg)


def _cmd_export(cfg: C.ExportConfig) -> None:
    from .export.vllm import export

    export(cfg)


def _cmd_quickstart(cfg) -> None:
    from .quickstart import quickstart

    quickstart(cfg)


COMMANDS: dict[str, tuple[type, callable, str]] = {
    "prepare": (C.PrepareConfig, _cmd_prepare, "tokenize chat data with the assistant loss mask"),
    "regenerate": (C.RegenerateConfig, _cmd_regenerate, "let the verifier write the answers (on-policy data)"),
    "vocab": (C.VocabConfig, _cmd_vocab, "build the draft vocabulary (d2t, t2d)"),
    "extract": (C.ExtractConfig, _cmd_extract, "store verifier hidden states for training (or --validate them)"),
    "train": (C.TrainConfig, _cmd_train, "train a P-EAGLE or EAGLE-3 drafter (torchrun for DDP / FSDP)"),
    "generate": (C.GenerateConfig, _cmd_generate, "speculative decoding with a drafter (plain decoding without)"),
    "bench": (C.BenchConfig, _cmd_bench, "acceptance length and speedup of drafters vs plain decoding"),
    "export": (C.ExportConfig, _cmd_export, "write a checkpoint vLLM serves; print the `vllm serve` command"),
}


def register(name: str, cfg_cls: type, fn, help_text: str) -> None:
    """Add a subcommand (used by modules that add steps of the workflow)."""
    COMMANDS[name] = (cfg_cls, fn, help_text)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subcommand per workflow step."""
    from .quickstart import QuickstartConfig

    commands = dict(COMMANDS)
    commands["quickstart"] = (QuickstartConfig, _cmd_quickstart, "run the whole workflow on the embedded verifier")
    parser = argparse.ArgumentParser(prog="paradraft", description=WORKFLOW, formatter_class=_Fmt)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (cls, _fn, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=(cls.__doc__ or help_text), formatter_class=_Fmt)
        C.add_config_args(p, cls)
        p.set_defaults(_run=(cls, _fn))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `paradraft` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    cls, fn = args._run
    try:
        cfg = C.config_from_args(cls, args)
        fn(cfg)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (C.ConfigError, ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        if os.environ.get("PARADRAFT_DEBUG"):
            raise
        print(f"paradraft {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
