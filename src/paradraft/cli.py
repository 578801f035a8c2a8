"""The `paradraft` command line: one entry point for the whole workflow."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from . import config as C
from .errors import PAUSED_EXIT, Paused, UserError

# the machine, not paradraft, is at fault: no space, a read-only filesystem, no permission, quota
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO}

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


def _lazy(target: str):
    """A command function imported on first use ("module:function"), so `paradraft --help` stays fast."""

    def run(cfg):
        import importlib

        module, fn = target.split(":")
        getattr(importlib.import_module(module, __package__), fn)(cfg)

    return run


# name -> (config class, "module:function", help). The config class is the typed config the function receives.
COMMANDS: dict[str, tuple[type, callable, str]] = {
    "prepare": (C.PrepareConfig, _lazy(".data.prepare:prepare"), "tokenize chat data with the assistant loss mask"),
    "regenerate": (C.RegenerateConfig, _lazy(".regenerate:regenerate"),
                   "let the verifier write the answers (on-policy data)"),
    "vocab": (C.VocabConfig, _lazy(".data.vocab:vocab"), "build the draft vocabulary (d2t, t2d)"),
    "extract": (C.ExtractConfig, _lazy(".data.hidden_states:extract"),
                "store verifier hidden states for training (or --validate them)"),
    "train": (C.TrainConfig, _lazy(".train.trainer:train"),
              "train a P-EAGLE or EAGLE-3 drafter (torchrun for DDP / FSDP)"),
    "generate": (C.GenerateConfig, _lazy(".decode.generate:generate"),
                 "speculative decoding with a drafter (plain decoding without)"),
    "bench": (C.BenchConfig, _lazy(".bench.run:bench"), "acceptance length and speedup of drafters vs plain decoding"),
    "export": (C.ExportConfig, _lazy(".export.vllm:export"),
               "write a checkpoint vLLM serves; print the `vllm serve` command"),
    "quickstart": (C.QuickstartConfig, _lazy(".quickstart:quickstart"),
                   "run the whole workflow on the embedded verifier"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one subcommand per workflow step."""
    parser = argparse.ArgumentParser(prog="paradraft", description=WORKFLOW, formatter_class=_Fmt)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (cls, _fn, help_text) in COMMANDS.items():
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
    cfg = None
    try:
        cfg = C.config_from_args(cls, args)
        fn(cfg)
    except KeyboardInterrupt as e:
        print(f"paradraft {args.command}: interrupted" + (f" ({e})" if str(e) else ""), file=sys.stderr)
        return 130
    except Paused as e:
        print(f"paradraft {args.command}: paused: {e}", file=sys.stderr)
        return PAUSED_EXIT
    except UserError as e:  # bad input the user can fix: one line. Anything else is a bug and keeps its traceback.
        if os.environ.get("PARADRAFT_DEBUG"):
            raise
        print(f"paradraft {args.command}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRNOS or os.environ.get("PARADRAFT_DEBUG"):
            raise
        # the file the system named, else the command's output (a write through an open file names none)
        where = e.filename or (f"--output {cfg.output}" if getattr(cfg, "output", None) else "")
        print(f"paradraft {args.command}: error: {where}: {e.strerror}" if where else
              f"paradraft {args.command}: error: {e.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
