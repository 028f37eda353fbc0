"""`dormouse pull owner/repo[:QUANT]`: fetch a model by name ahead of serving it.

The same code as `hf_repo` at start (daemon/model/hub.py), into the same
place, so what `pull` fetched is what `serve` finds in the cache: `dormouse
serve --hf-repo owner/repo:QUANT` then starts without a download. That place is
state_dir/models (huggingface_hub's cache layout), the state directory found
as serve finds it (--state-dir, the config file's state_dir, DORMOUSE_STATE_DIR,
$STATE_DIRECTORY, ~/.cache/dormouse), unless HF_HUB_CACHE or HF_HOME names a
cache explicitly (hub_cache_dir). Progress goes to stderr
(bars on a terminal, a line each tenth otherwise); the local paths go to
stdout, one `model: PATH` line (and `mmproj: PATH`), for scripts.
"""

from __future__ import annotations

import argparse
import sys


def add_pull_command(subparsers) -> argparse.ArgumentParser:
    sub = subparsers.add_parser(
        "pull", help="download a GGUF model from Hugging Face by name (owner/repo[:QUANT]) into its cache",
        description="Download a model (and its projector, when the repository has one) into state_dir/models "
                    "(huggingface_hub's cache layout; HF_HUB_CACHE or HF_HOME, when set, names another cache), or "
                    "find it there: where `dormouse serve` looks for it. HF_TOKEN reads private and gated "
                    "repositories; HF_ENDPOINT names a mirror; HF_HUB_OFFLINE=1 uses the cache alone.")
    sub.add_argument("repo", help="owner/repo[:QUANT], as llama-server's -hf: the quant tag (case-insensitive) picks "
                                  "the .gguf whose name holds it; none: Q4_K_M, else Q8_0, else the first")
    sub.add_argument("--hf-file", "--file", dest="hf_file", default=None,
                     help="this .gguf of the repository rather than the one the quant tag picks")
    sub.add_argument("--no-mmproj", dest="mmproj", action="store_false",
                     help="leave the repository's projector (mmproj) out")
    sub.add_argument("--state-dir", default=None,
                     help="the state directory serve will use (default: as serve finds it: the config file's "
                          "state_dir, DORMOUSE_STATE_DIR, $STATE_DIRECTORY, else ~/.cache/dormouse)")
    sub.add_argument("--config", default=None,
                     help="the TOML settings file serve reads (for its state_dir; default: as serve finds it)")
    return sub


def run_pull(args: argparse.Namespace) -> int:
    from config import ConfigError, load_settings
    from daemon.model.download_progress import line_progress
    from daemon.model.files import ModelFileError, check_gguf, state_dir
    from daemon.model.hub import HubError, hub_cache_dir, pull

    def report(line: str) -> None:
        print(f"dormouse: {line}", file=sys.stderr, flush=True)

    try:  # the state directory exactly as serve would find it
        settings = load_settings(getattr(args, "config", None), {"state_dir": getattr(args, "state_dir", None)})
    except ConfigError as exc:
        print(f"dormouse: {exc}", file=sys.stderr)
        return 2
    try:
        pulled = pull(args.repo, args.hf_file, with_mmproj=args.mmproj, cache_dir=hub_cache_dir(state_dir(settings)),
                      progress=None if sys.stderr.isatty() else line_progress(report))
        for part in pulled.parts:
            check_gguf(part, "model")
        if pulled.mmproj is not None:
            check_gguf(pulled.mmproj, "projector")
    except (HubError, ModelFileError) as exc:
        print(f"dormouse: pull {str(args.repo)[:120]}: {exc}", file=sys.stderr)
        return 1
    if pulled.from_cache_only:
        report(f"{pulled.name} from the cache (the hub was not asked)")
    print(f"model: {pulled.model.absolute()}")
    if len(pulled.parts) > 1:
        print(f"parts: {len(pulled.parts)} (beside the model)")
    if pulled.mmproj is not None:
        print(f"mmproj: {pulled.mmproj.absolute()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m daemon.pull`, the same as `dormouse pull`."""
    parser = argparse.ArgumentParser(prog="dormouse")
    add_pull_command(parser.add_subparsers(dest="command", required=True))
    return run_pull(parser.parse_args(["pull", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
